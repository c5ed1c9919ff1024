"""The Triton RoPE kernel (`mtprun.kernels.rope`) against a float64 torch reference, forward and
backward, at several shapes and dtypes. Runs on CUDA, or on CPU under the Triton interpreter
(`test_triton_head_loss.py` runs this module in a process with TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from .elementwise import TOLERANCE, triton_device

DEVICE = triton_device()

from mtprun.kernels.rope import rotate_qk  # noqa: E402  (after the skip: imports triton)


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin in float64 (HF's formula)."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def angles(tokens: int, dim: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """cos and sin [T, 1, 1, d] of random angles; the halves differ, so that a kernel mixing
    them up fails (real tables repeat one half)."""
    theta = torch.rand(tokens, 1, 1, dim, generator=generator) * 100
    return theta.cos().to(DEVICE), theta.sin().to(DEVICE)


def qkv_views(tokens: int, heads: int, groups: int, dim: int, dtype, generator):
    """query and key as Megatron hands them over: strided views into one fused projection."""
    fused = torch.randn(tokens, 1, heads + 2 * groups, dim, generator=generator).to(DEVICE, dtype)
    return fused[:, :, :heads], fused[:, :, heads : heads + groups]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "groups", "dim"),
    [(37, 12, 2, 128), (5, 4, 4, 64), (19, 3, 1, 80), (1, 1, 1, 2)],
)
def test_forward_and_backward_match_float64(tokens, heads, groups, dim, dtype) -> None:
    generator = torch.Generator().manual_seed(tokens * 1000 + dim)
    query, key = qkv_views(tokens, heads, groups, dim, dtype, generator)
    query.requires_grad_()
    key.requires_grad_()
    cos, sin = angles(tokens, dim, generator)
    q_out, k_out = rotate_qk(query, key, cos, sin)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    assert q_out.dtype == dtype and k_out.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(q_out.double(), reference(query, cos, sin), rtol=rtol, atol=atol)
    torch.testing.assert_close(k_out.double(), reference(key, cos, sin), rtol=rtol, atol=atol)

    grad_q = torch.randn(q_out.shape, generator=generator).to(DEVICE, dtype)
    grad_k = torch.randn(k_out.shape, generator=generator).to(DEVICE, dtype)
    (q_out.float() * grad_q).sum().add((k_out.float() * grad_k).sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (query, key)]
    expected = (reference(leaves[0], cos, sin) * grad_q.double()).sum()
    expected = expected + (reference(leaves[1], cos, sin) * grad_k.double()).sum()
    expected.backward()
    torch.testing.assert_close(query.grad.double(), leaves[0].grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(key.grad.double(), leaves[1].grad, rtol=rtol, atol=atol)


def test_noncontiguous_incoming_gradients() -> None:
    generator = torch.Generator().manual_seed(7)
    query, key = qkv_views(9, 4, 2, 64, torch.float32, generator)
    query.requires_grad_()
    cos, sin = angles(9, 64, generator)
    q_out, _ = rotate_qk(query, key, cos, sin)
    grad = torch.randn(64, 9, 4, generator=generator).to(DEVICE).permute(1, 2, 0).unsqueeze(1)
    q_out.backward(grad)
    leaf = query.detach().double().requires_grad_()
    reference(leaf, cos, sin).backward(grad.double())
    torch.testing.assert_close(query.grad.double(), leaf.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "angle_tokens", "message"),
    [
        ((4, 1, 2, 7), (4, 1, 1, 7), 4, "even head dim"),
        ((4, 1, 2, 8), (3, 1, 1, 8), 4, "same tokens"),
        ((4, 1, 2, 8), (4, 1, 1, 8), 5, "one angle row per token"),
    ],
)
def test_bad_shapes_are_refused(q_shape, k_shape, angle_tokens, message) -> None:
    query, key = torch.zeros(q_shape, device=DEVICE), torch.zeros(k_shape, device=DEVICE)
    cos = torch.zeros(angle_tokens, 1, 1, q_shape[-1], device=DEVICE)
    with pytest.raises(ValueError, match=message):
        rotate_qk(query, key, cos, cos)
