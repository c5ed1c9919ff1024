"""`merged_attention`: causal attention of query pieces over key ranges, each piece as at most
two fused-kernel blocks merged by their log-sum-exp (the trainer's attention under context
parallelism on CUDA, `mtprun.runner.trainer.attention.SequencePieces`).

Shapes: q [Tq, H, d], k [Tk, G, d], v [Tk, G, dv] (H a multiple of G: grouped-query
attention, query head h reads key head h // (H / G)) -> out [Tq, H, dv]. A `Piece` (qa, qb,
ka, kb) says that queries [qa, qb) see keys [ka, kb), causally aligned at the end: query qa + i
sees keys [ka, kb - (qb - qa) + i]. The pieces cover the queries once, in order. With
n = qb - qa and c = kb - n, the piece's attention splits into
    the diagonal block: queries vs keys [c, kb), square, causal (top left),
    the block before it: queries vs keys [ka, c), no mask (absent when ka == c),
each computed by a kernel that also returns its log-sum-exp per query, l_i, and merged:
    l = log(exp(l_1) + exp(l_2)),   out = exp(l_1 - l) out_1 + exp(l_2 - l) out_2.
Backward: a block's attention backward given the merged out and merged l (instead of its
own) yields exactly that block's share of dq, dk and dv (its probabilities exp(s - l) and
the row term sum(dout * out) are those of the whole softmax): the shares are summed in
float32, as ring and flash attention do across their key blocks.

Kernels (`BlockKernel`): cuDNN's fused attention on CUDA (float16/bfloat16; the speed of
SDPA on Hopper, where FlexAttention takes 1.5-1.8x its time), torch's flash attention for
the CPU there (any float dtype; it lets the tests check the merge and backward exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, NamedTuple

import torch


class Piece(NamedTuple):
    """Queries [q_start, q_end) see keys [k_start, k_end), causally aligned at the end."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int

    @property
    def diagonal(self) -> int:
        """First key of the square causal block (the piece's last q_end - q_start keys)."""
        return self.k_end - (self.q_end - self.q_start)

    def blocks(self) -> list[tuple[int, int, bool]]:
        """(first key, end key, causal) of the diagonal block and, if any, the one before."""
        before = [(self.k_start, self.diagonal, False)] if self.k_start < self.diagonal else []
        return [(self.diagonal, self.k_end, True), *before]


@dataclass(frozen=True)
class BlockKernel:
    """Attention over one block with its log-sum-exp, and that attention's backward.

    forward(q, k, v, causal) -> (out, lse, aux): q [1, H, n, d], k and v [1, H or G, s, d]
    (strided views allowed, last dim contiguous); out [1, H, n, dv]; lse the kernel's own
    layout of [H, n] (natural log); aux what its backward needs besides. backward(grad, q, k,
    v, out, lse, aux, causal) -> (dq, dk, dv) with `out` and `lse` laid out as forward gave
    them. `grouped`: the kernel takes fewer key heads than query heads itself (else keys
    and values are repeated per query head, and their gradients summed back).
    """

    name: str
    grouped: bool
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cpu_forward(q, k, v, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, ()


def _cpu_backward(grad, q, k, v, out, lse, aux, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal
    )


def _cudnn_forward(q, k, v, causal):
    # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug);
    # the backward takes them back as they came (torch's ring attention does the same).
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)
    )
    return out, lse, (seed, offset, cum_q, cum_k, max_q, max_k)


def _cudnn_backward(grad, q, k, v, out, lse, aux, causal):
    seed, offset, cum_q, cum_k, max_q, max_k = aux
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal
    )


CPU_FLASH = BlockKernel("cpu-flash", True, _cpu_forward, _cpu_backward)
CUDNN = BlockKernel("cudnn", True, _cudnn_forward, _cudnn_backward)
CUDNN_DTYPES = (torch.float16, torch.bfloat16)


def block_kernel(device: torch.device | str, dtype: torch.dtype) -> BlockKernel | None:
    """The block kernel for `dtype` on `device`; None where there is none (CUDA float32:
    cuDNN's attention takes half precision only)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_FLASH
    if device.type == "cuda" and dtype in CUDNN_DTYPES:
        return replace(CUDNN, grouped=_cudnn_takes_grouped_heads(device))
    return None


@cache
def _cudnn_takes_grouped_heads(device: torch.device) -> bool:
    """Whether cuDNN's attention computes grouped-query attention itself, forward and
    backward: checked once per device on a tiny input against the keys repeated per query
    head (torch's op accepts fewer key heads on recent versions; if one refuses or gets it
    wrong, the repeat is taken)."""
    g = torch.Generator(device).manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, h, 128, 64, device=device, dtype=torch.bfloat16, generator=g)
        for h in (2, 1, 1, 2)
    )
    kernel = replace(CUDNN, grouped=True)
    try:
        got = _block_grads(kernel, q, k, v, grad, causal=True)
    except RuntimeError:
        return False
    want = _block_grads(replace(CUDNN, grouped=False), q, k, v, grad, causal=True)
    return all(torch.allclose(a, b, rtol=2e-2, atol=2e-2) for a, b in zip(got, want, strict=True))


def _block_grads(kernel, q, k, v, grad, causal):
    """One block's output and gradients (the probe above)."""
    out, lse, aux = _block_forward(kernel, q, k, v, causal)
    return (out, *_block_backward(kernel, grad, q, k, v, out, lse, aux, causal))


def _block_forward(kernel: BlockKernel, q, k, v, causal):
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1 and not kernel.grouped:
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    return kernel.forward(q, k, v, causal)


def _block_backward(kernel: BlockKernel, grad, q, k, v, out, lse, aux, causal):
    groups, repeat = k.shape[1], q.shape[1] // k.shape[1]
    if repeat == 1 or kernel.grouped:
        return kernel.backward(grad, q, k, v, out, lse, aux, causal)
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    dq, dk, dv = kernel.backward(grad, q, k, v, out, lse, aux, causal)
    return dq, dk.unflatten(1, (groups, repeat)).sum(2), dv.unflatten(1, (groups, repeat)).sum(2)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, d] -> [1, heads, n, d], a view (the layout SDPA gets from [b, n, heads, d])."""
    return x.transpose(0, 1)[None]


class MergedAttention(torch.autograd.Function):
    """See the module docstring. Saves q, k, v, the output and each piece's merged lse."""

    @staticmethod
    def forward(ctx, q, k, v, pieces: Sequence[Piece], kernel: BlockKernel):
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        lses, auxes = [], []
        for p in pieces:
            qp = _heads_first(q[p.q_start : p.q_end])
            blocks = [
                _block_forward(kernel, qp, _heads_first(k[a:b]), _heads_first(v[a:b]), causal)
                for a, b, causal in p.blocks()
            ]
            piece_out, lse = _merge(blocks)
            out[p.q_start : p.q_end] = piece_out[0].transpose(0, 1)
            lses.append(lse)
            auxes.append([aux for _, _, aux in blocks])
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.pieces, ctx.kernel, ctx.auxes = pieces, kernel, auxes
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, *lses = ctx.saved_tensors
        grad = grad.contiguous()
        accumulate = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = (torch.zeros_like(t, dtype=accumulate) for t in (q, k, v))
        for p, lse, auxes in zip(ctx.pieces, lses, ctx.auxes, strict=True):
            qp, op, gp = (_heads_first(t[p.q_start : p.q_end]) for t in (q, out, grad))
            for (a, b, causal), aux in zip(p.blocks(), auxes, strict=True):
                kb, vb = _heads_first(k[a:b]), _heads_first(v[a:b])
                dqb, dkb, dvb = _block_backward(ctx.kernel, gp, qp, kb, vb, op, lse, aux, causal)
                dq[p.q_start : p.q_end] += dqb[0].transpose(0, 1)
                dk[a:b] += dkb[0].transpose(0, 1)
                dv[a:b] += dvb[0].transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _merge(blocks):
    """[(out [1, H, n, dv], lse, aux)] of one piece's blocks -> (out, lse): the softmax over
    all their keys. The merged lse keeps the kernel's layout (its backward reads it)."""
    if len(blocks) == 1:
        return blocks[0][0], blocks[0][1]
    (out_1, raw_1, _), (out_2, raw_2, _) = blocks
    heads, n = out_1.shape[1:3]
    lse_1, lse_2 = raw_1.reshape(heads, n), raw_2.reshape(heads, n)
    lse = torch.logaddexp(lse_1, lse_2)
    weight_1, weight_2 = ((x - lse).exp()[None, :, :, None] for x in (lse_1, lse_2))
    out = weight_1 * out_1.to(weight_1.dtype) + weight_2 * out_2.to(weight_2.dtype)
    merged = torch.empty_like(raw_1)
    merged.copy_(lse.reshape(raw_1.shape))
    # Written into a tensor laid out as the kernel's own output (its backward reads
    # strides as they came; torch's cuDNN path allocates the output like q).
    return out.to(out_1.dtype), merged


def merged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: Sequence[Piece],
    kernel: BlockKernel | None = None,
) -> torch.Tensor:
    """q [Tq, H, d], k [Tk, G, d], v [Tk, G, dv] -> [Tq, H, dv]: each piece's queries over its
    keys (module docstring), differentiable in q, k and v. `kernel`: `block_kernel`'s for q's
    device and dtype unless given."""
    if q.dim() != 3 or k.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"merged_attention takes q [Tq, H, d], k [Tk, G, d], v [Tk, G, dv]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query heads {q.shape[1]} must be a multiple of key heads {k.shape[1]}, and "
            f"q and k must share the head dim ({q.shape[-1]} vs {k.shape[-1]})"
        )
    _check_pieces(pieces, q.shape[0], k.shape[0])
    if kernel is None:
        kernel = block_kernel(q.device, q.dtype)
        if kernel is None:
            raise ValueError(f"no fused attention kernel with lse for {q.dtype} on {q.device}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    return MergedAttention.apply(q, k, v, tuple(pieces), kernel)


def _check_pieces(pieces: Sequence[Piece], queries: int, keys: int) -> None:
    covered = 0
    for p in pieces:
        if p.q_start != covered or p.q_end <= p.q_start:
            raise ValueError(
                f"pieces must cover the {queries} queries once, in order: {p} does not "
                f"start at query {covered} or is empty"
            )
        if not 0 <= p.k_start <= p.diagonal or p.k_end > keys:
            raise ValueError(
                f"{p} needs keys [{p.k_start}, {p.k_end}) holding at least its "
                f"{p.q_end - p.q_start} queries, within the {keys} keys"
            )
        covered = p.q_end
    if covered != queries:
        raise ValueError(f"pieces cover {covered} of the {queries} queries")
