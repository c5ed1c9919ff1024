"""Qwen3.5's fused norms on CUDA (fla's Triton kernels) against their float64 torch reference:
outputs and gradients, float32 and bfloat16, fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from mtprun.kernels.fused_norms import gated_rms_norm, l2_normalize, zero_centered_rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
EPS = 1e-6


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shape]


def _check(fn, tensors, dtype):
    """fn on CUDA `dtype` copies vs fn on float64 CPU copies (the torch path): output and
    the gradient of every input under a random upstream gradient."""
    got_in = [t.to("cuda", dtype).requires_grad_() for t in tensors]
    want_in = [t.clone().requires_grad_() for t in tensors]
    got, want = fn(*got_in), fn(*want_in)
    assert got.dtype == dtype and got.shape == want.shape
    upstream = torch.randn(want.shape, dtype=torch.float64)
    got.backward(upstream.to("cuda", dtype))
    want.backward(upstream)
    tol = TOLERANCE[dtype]
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double().cpu(), want.detach(), rtol=tol, atol=tol * scale)
    for g_in, w_in in zip(got_in, want_in, strict=True):
        w_scale = w_in.grad.abs().max().item()
        torch.testing.assert_close(
            g_in.grad.double().cpu(), w_in.grad, rtol=tol, atol=tol * w_scale
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centered_rms_norm(dtype):
    x, w = _inputs([(512, 1, 256), (256,)], dtype, seed=0)
    _check(lambda x, w: zero_centered_rms_norm(x, 0.1 * w, EPS), [x, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(dtype):
    o, z, w = _inputs([(512, 8, 128), (512, 8, 128), (128,)], dtype, seed=1)
    _check(lambda o, z, w: gated_rms_norm(o, z, 1 + 0.1 * w, EPS), [o, z, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_of_a_strided_view(dtype):
    (qkv,) = _inputs([(512, 4, 3 * 128)], dtype, seed=2)
    _check(lambda t: l2_normalize(t[..., 128:256], EPS), [qkv], dtype)
