"""`rotate_qk`: rotary position embedding of a layer's queries and keys in one Triton launch
per direction (the trainer's packed attention, on CUDA).

Half-split layout (Megatron's and HF's): for x = [x1, x2] along the head dim,
    y1 = x1 cos1 - x2 sin1,    y2 = x2 cos2 + x1 sin2
and the backward applies the transpose,
    dx1 = dy1 cos1 + dy2 sin2,  dx2 = dy2 cos2 - dy1 sin1,
so nothing but cos and sin is kept for it. The arithmetic runs in float32 and rounds once.

Why a kernel and not torch.compile: the trainer's step is bound by host time, and a compiled
region costs ~0.3 ms of host work to enter per layer and micro batch (guards, the AOT wrapper,
its backward node), against ~0.03 ms for a Triton launch; the GPU work is the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    token,
    x_token_stride,
    x_head_stride,
    out_token_stride,
    heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    INVERSE: tl.constexpr,
):
    """One token's `heads` heads of x ([heads, 2 HALF] at the given strides) rotated into out
    (contiguous heads)."""
    head = tl.arange(0, BLOCK_HEADS)[:, None]
    col = tl.arange(0, BLOCK_HALF)[None, :]
    inside = (head < heads) & (col < HALF)
    angle = token * 2 * HALF + col
    cos1 = tl.load(cos_ptr + angle, mask=col < HALF).to(tl.float32)
    cos2 = tl.load(cos_ptr + angle + HALF, mask=col < HALF).to(tl.float32)
    sin1 = tl.load(sin_ptr + angle, mask=col < HALF).to(tl.float32)
    sin2 = tl.load(sin_ptr + angle + HALF, mask=col < HALF).to(tl.float32)
    src = x_ptr + token.to(tl.int64) * x_token_stride + head * x_head_stride + col
    x1 = tl.load(src, mask=inside).to(tl.float32)
    x2 = tl.load(src + HALF, mask=inside).to(tl.float32)
    if INVERSE:
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    dst = out_ptr + token.to(tl.int64) * out_token_stride + head * (2 * HALF) + col
    tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def rotate_qk_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    q_heads,
    k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INVERSE: tl.constexpr,
):
    """Program t rotates token t's query and key heads (by -angle when INVERSE)."""
    token = tl.program_id(0)
    _rotate_heads(
        q_ptr, q_out_ptr, cos_ptr, sin_ptr, token, q_token_stride, q_head_stride,
        q_heads * 2 * HALF, q_heads, HALF, BLOCK_HALF, BLOCK_Q, INVERSE,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, cos_ptr, sin_ptr, token, k_token_stride, k_head_stride,
        k_heads * 2 * HALF, k_heads, HALF, BLOCK_HALF, BLOCK_K, INVERSE,
    )  # fmt: skip


def _as_token_heads(x: torch.Tensor) -> torch.Tensor:
    """[T, 1, heads, d] (or [T, heads, d]) -> a [T, heads, d] view whose head dim is dense."""
    x = x.reshape(-1, *x.shape[-2:])
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _as_token_heads(query), _as_token_heads(key)
    tokens, dim = q.shape[0], q.shape[-1]
    cos, sin = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if tokens:
        rotate_qk_kernel[(tokens,)](
            q, k, q_out, k_out, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q.shape[1], k.shape[1],
            HALF=dim // 2,
            BLOCK_HALF=triton.next_power_of_2(dim // 2),
            BLOCK_Q=triton.next_power_of_2(q.shape[1]),
            BLOCK_K=triton.next_power_of_2(k.shape[1]),
            INVERSE=inverse,
        )  # fmt: skip
    return q_out, k_out


class RotateQK(torch.autograd.Function):
    """RoPE of queries and keys, one kernel launch forward and one backward.

    query [T, 1, heads, d] and key [T, 1, groups, d] (any strides with a dense last dim, e.g.
    Megatron's views into the fused QKV projection), cos and sin [T, 1, 1, d] (float32; the
    angles of each token's position). d is even. Returns new contiguous tensors of the inputs'
    shapes and dtypes. Saves cos and sin only. No collectives.
    """

    @staticmethod
    def forward(ctx, query, key, cos, sin):
        tokens = query.numel() // (query.shape[-2] * query.shape[-1])
        key_tokens = key.numel() // (key.shape[-2] * key.shape[-1])
        if query.shape[-1] % 2 or key.shape[-1] != query.shape[-1] or key_tokens != tokens:
            raise ValueError(
                f"RoPE needs queries and keys of the same tokens and one even head dim, got "
                f"{tuple(query.shape)} and {tuple(key.shape)}"
            )
        if cos.numel() != tokens * query.shape[-1] or cos.shape != sin.shape:
            raise ValueError(
                f"cos and sin must hold one angle row per token: got {tuple(cos.shape)} and "
                f"{tuple(sin.shape)} for queries {tuple(query.shape)}"
            )
        ctx.save_for_backward(cos, sin)
        return _launch(query, key, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad_query, grad_key):
        cos, sin = ctx.saved_tensors
        grad_q, grad_k = _launch(grad_query, grad_key, cos, sin, inverse=True)
        return grad_q, grad_k, None, None


def rotate_qk(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, key) rotated by their tokens' angles; see `RotateQK`."""
    return RotateQK.apply(query, key, cos, sin)
