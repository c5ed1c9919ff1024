"""The Triton SwiGLU kernel (`mtprun.kernels.swiglu`) against a float64 torch reference,
forward and backward, at several shapes and dtypes. Runs on CUDA, or on CPU under the Triton
interpreter (`test_triton_head_loss.py` runs this module in a process with TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from .elementwise import TOLERANCE, triton_device

DEVICE = triton_device()

from mtprun.kernels.swiglu import swiglu  # noqa: E402  (after the skip: imports triton)


def reference(y: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for y = [a, b], in float64 (Megatron's formula)."""
    a, b = y.double().chunk(2, -1)
    return torch.nn.functional.silu(a) * b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13, 1, 2 * 1100), (3, 2, 2 * 64), (1, 2), (0, 1, 8)])
def test_forward_and_backward_match_float64(shape, dtype) -> None:
    generator = torch.Generator().manual_seed(sum(shape) * 7 + len(shape))
    y = (torch.randn(shape, generator=generator) * 3).to(DEVICE, dtype).requires_grad_()
    out = swiglu(y)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference(y), rtol=rtol, atol=atol)

    grad = torch.randn(out.shape, generator=generator).to(DEVICE, dtype)
    out.backward(grad)
    leaf = y.detach().double().requires_grad_()
    reference(leaf).backward(grad.double())
    torch.testing.assert_close(y.grad.double(), leaf.grad, rtol=rtol, atol=atol)


def test_noncontiguous_input_and_gradient() -> None:
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(2 * 96, 11, generator=generator).to(DEVICE).requires_grad_()
    y = base.t()  # [11, 192], column-major
    out = swiglu(y)
    grad = torch.randn(96, 11, generator=generator).to(DEVICE).t()
    out.backward(grad)
    leaf = base.detach().double().requires_grad_()
    reference(leaf.t()).backward(grad.double())
    torch.testing.assert_close(out.double(), reference(y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base.grad.double(), leaf.grad, rtol=1e-5, atol=1e-5)


def test_odd_width_is_refused() -> None:
    with pytest.raises(ValueError, match="halves"):
        swiglu(torch.zeros(2, 7, device=DEVICE))
