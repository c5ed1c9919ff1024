"""The Triton RMSNorm (`mtprun.kernels.rms_norm`) against a float64 torch reference, forward,
input gradient and weight gradient, at several shapes and dtypes: hidden-size rows, per-head
rows of 128 (many rows a program, the backward's programs striding over several blocks), an
odd width, one row, none. Runs on CUDA, or on CPU under the Triton interpreter
(`test_triton_head_loss.py` runs this module in a process with TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from .elementwise import TOLERANCE, triton_device

DEVICE = triton_device()

from mtprun.kernels.rms_norm import RMSNormFunction  # noqa: E402  (after the skip)

EPS = 1e-6


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13, 1, 1100), (20, 9, 128), (3, 2048), (1, 8), (0, 1, 16)])
def test_forward_and_backward_match_float64(shape, dtype) -> None:
    generator = torch.Generator().manual_seed(sum(shape) * 5 + len(shape))
    x = (torch.randn(shape, generator=generator) * 2 + 0.3).to(DEVICE, dtype).requires_grad_()
    weight = (1 + torch.randn(shape[-1], generator=generator) / 4).to(DEVICE, dtype)
    weight.requires_grad_()
    y = RMSNormFunction.apply(x, weight, EPS)
    assert y.shape == x.shape and y.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), reference(x, weight), rtol=rtol, atol=atol)

    grad = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    reference(x64, w64).backward(grad.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=rtol, atol=atol)
    # The weight gradient sums over every row: its tolerance grows with the row count's root.
    rows = max(x.numel() // shape[-1], 1)
    scale = rows**0.5 if dtype == torch.bfloat16 else 1.0
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=rtol, atol=atol * scale)


def test_noncontiguous_input_and_gradient() -> None:
    generator = torch.Generator().manual_seed(11)
    base = torch.randn(96, 40, generator=generator).to(DEVICE).requires_grad_()
    x = base.t()  # [40, 96], column-major
    weight = torch.rand(96, generator=generator).to(DEVICE).requires_grad_()
    y = RMSNormFunction.apply(x, weight, EPS)
    grad = torch.randn(96, 40, generator=generator).to(DEVICE).t()
    y.backward(grad)
    b64 = base.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    reference(b64.t(), w64).backward(grad.double())
    torch.testing.assert_close(y.double(), reference(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_a_weight_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        RMSNormFunction.apply(torch.ones(2, 8, device=DEVICE), torch.ones(7, device=DEVICE), EPS)
