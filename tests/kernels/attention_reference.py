"""What the GPU tests of packed attention share: a row's boundaries, a float32 per-sequence
causal reference, an output with its q/k/v gradients, and a CUDA-event timing (which the
gated delta test takes too)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def row_boundaries(lengths: list[int]) -> torch.Tensor:
    """[n + 1] int32 boundaries of sequences of `lengths` tokens packed in one row (CPU)."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def per_sequence_reference(q, k, v, lengths: list[int]) -> torch.Tensor:
    """q [T, 1, H, d], k and v [T, 1, G, d] -> [T, 1, H * d]: float32 causal SDPA on each
    sequence's span, keys and values repeated per query head."""
    q, k, v = (t.squeeze(1).transpose(0, 1).float() for t in (q, k, v))  # [heads, T, d]
    k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], 0) for t in (k, v))
    outs, start = [], 0
    for n in lengths:
        span = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                q[None, :, span], k[None, :, span], v[None, :, span], is_causal=True
            )[0]
        )
        start += n
    return torch.cat(outs, 1).transpose(0, 1).flatten(1).unsqueeze(1)


def output_and_grads(attend: Callable, q, k, v, grad) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of `attend(q, k, v)` under the output gradient `grad`."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype)))


def milliseconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Mean CUDA time of `fn()` over `repeats` calls after one untimed call (FlexAttention's
    compile, cuDNN's plans)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats
