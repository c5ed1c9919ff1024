"""Context parallelism: each of the cp processes of a context-parallel group holds a share of
every micro batch's tokens, and attention gathers the keys and values of all of them.

The packed row of T tokens is cut into 2*cp near-equal chunks and rank r holds chunks r and
2*cp-1-r, one early and one late, so that every rank's queries see about as many causal keys.
Everything but attention works token by token on the local share; attention all-gathers every
rank's keys and values (each rank's padded to the same width, `gather_keys`) and masks them
with the packed causal mask between the local queries' and the gathered keys' positions in
the row (`mtprun.runner.trainer.attention`). On CUDA a row of a few sequences takes no mask:
the gathered keys are put back in row order, and each piece of a sequence in a local chunk
attends its sequence's keys up to the piece's end as two fused-kernel blocks (the causal
square on the diagonal, the unmasked keys before it) merged by their log-sum-exp
(`SequencePieces`, `mtprun.kernels.merged_attention`). Gated DeltaNet layers (Qwen3.5)
also reach across chunk edges: they gather the conv inputs and recurrent states that their
chunks hand on (`mtprun.runner.trainer.gated_delta_net.ContextParallelPlan`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from mtprun.data.batch import PackedBatch

_PER_TOKEN = ("input_ids", "targets", "loss_mask", "position_ids")
_PER_TARGET = ("advantages", "old_logprobs", "ref_logprobs", "sampler_logprobs")


@dataclass(frozen=True)
class TokenShard:
    """The tokens of a packed row of `num_tokens` that context-parallel rank `rank` of `size`
    holds (size 1: all of them)."""

    rank: int
    size: int
    num_tokens: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank {self.rank} is outside 0..{self.size - 1}")
        if self.num_tokens < 2 * self.size:
            raise ValueError(
                f"a micro batch of {self.num_tokens} tokens is too short for parallel.cp="
                f"{self.size}: each rank needs two chunks of at least one token"
            )

    @cached_property
    def index(self) -> torch.Tensor:
        """[T_local] positions in the row of this rank's tokens, ascending."""
        return self._positions(self.rank)

    @cached_property
    def width(self) -> int:
        """The most tokens any rank holds: every rank's keys are padded to it for the gather."""
        return max(sum(end - start for start, end in self._spans(r)) for r in range(self.size))

    @cached_property
    def spans(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(start, end) row positions of this rank's two chunks, early then late: its tokens
        are the first's, then the second's (`index`)."""
        return self._spans(self.rank)

    def key_order(self) -> torch.Tensor:
        """[num_tokens] index among the gathered keys (`key_positions` order) of each row
        position: what puts the gathered keys back in row order."""
        order = torch.empty(self.num_tokens, dtype=torch.long)
        for rank in range(self.size):
            local = rank * self.width
            for start, end in self._spans(rank):
                order[start:end] = torch.arange(local, local + end - start)
                local += end - start
        return order

    def local_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum of per-token `values` [num_tokens] over this rank's tokens (slices, no
        gather: the trainer calls it on the host for every micro batch)."""
        return sum(values[start:end].sum() for start, end in self.spans)

    def key_positions(self) -> torch.Tensor:
        """[size * width] row position of each gathered key, rank by rank, -1 for padding."""
        keys = torch.full((self.size, self.width), -1, dtype=torch.long)
        for r in range(self.size):
            positions = self._positions(r)
            keys[r, : len(positions)] = positions
        return keys.flatten()

    def take(self, batch: PackedBatch) -> PackedBatch:
        """This rank's tokens of `batch`. Their cu_seqlens is one span: sequences cross ranks,
        so only token-level reductions are meaningful on a share (the trainer refuses the
        others under cp > 1)."""
        if self.size == 1:
            return batch
        (a, b), (c, d) = self.spans
        # Two slices each: no index to copy to the device, no gather kernel.
        local: dict[str, Any] = {}
        for name in _PER_TOKEN + _PER_TARGET:
            value = getattr(batch, name)
            local[name] = None if value is None else torch.cat([value[a:b], value[c:d]])
        span = torch.tensor([0, b - a + d - c], dtype=batch.cu_seqlens.dtype)
        return replace(batch, **local, cu_seqlens=span.to(batch.cu_seqlens.device))

    def chunk_spans(self) -> list[tuple[int, int]]:
        """(start, end) row positions of the 2*size chunks in row order. Chunk c is held by
        rank c (c < size, its first `index` share) or 2*size-1-c (c >= size, its second)."""
        chunks = 2 * self.size
        edges = [i * self.num_tokens // chunks for i in range(chunks + 1)]
        return list(itertools.pairwise(edges))

    def _spans(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        chunks = self.chunk_spans()
        return chunks[rank], chunks[2 * self.size - 1 - rank]

    def _positions(self, rank: int) -> torch.Tensor:
        return torch.cat([torch.arange(start, end) for start, end in self._spans(rank)])


def gather_tokens(local: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[T_local, ...] on each rank of `group` -> [size * width, ...]: every rank's rows, each
    padded with zeros to `width`, rank by rank. One all_gather; no gradient."""
    padded = local
    if local.shape[0] < width:
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
    size = dist.get_world_size(group)
    out = local.new_empty((size * width, *local.shape[1:]))
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, padded, group=group)  # no copy out of a flat buffer
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.chunk(size)), padded, group=group)
    return out


def gather_row(local: torch.Tensor, shard: TokenShard, group: dist.ProcessGroup) -> torch.Tensor:
    """[T_local] values of `shard`'s tokens on each rank of `group` -> [T] of the whole row,
    on the CPU. One all_gather (device tensors under NCCL)."""
    gathered = gather_tokens(local, shard.width, group).cpu()
    return gathered[shard.key_order()]


class _GatherKeys(torch.autograd.Function):
    """Keys and values [T_local, b, groups, d] -> [cp * width, b, groups, d] of every rank,
    or, given `order` [T] (distinct indices into those gathered rows), [T, b, groups, d]: the
    gathered rows taken in that order.

    Forward: one all_gather over the context-parallel group (rows padded to `width`), then
    the gather by `order`. Backward: the gradient put back at `order`'s rows (a copy: the
    indices are distinct, so no atomic adds as index_select's own backward would issue; zeros
    at the padding), then summed over the group, as every rank's queries contribute to every
    rank's keys: one reduce_scatter on NCCL, one all_reduce on gloo (which has no
    reduce_scatter), after which each rank keeps its own rows.
    """

    @staticmethod
    def forward(
        ctx,
        local: torch.Tensor,
        width: int,
        group: dist.ProcessGroup,
        order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx.group, ctx.rows, ctx.width, ctx.order = group, local.shape[0], width, order
        gathered = gather_tokens(local.contiguous(), width, group)
        ctx.gathered_rows = gathered.shape[0]
        return gathered if order is None else gathered.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        if ctx.order is not None:
            full = grad.new_zeros((ctx.gathered_rows, *grad.shape[1:]))
            grad = full.index_copy_(0, ctx.order, grad)
        if dist.get_backend(ctx.group) == "nccl":
            mine = grad.new_empty((ctx.width, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        else:
            grad = grad.clone() if ctx.order is None else grad
            dist.all_reduce(grad, group=ctx.group)
            start = dist.get_rank(ctx.group) * ctx.width
            mine = grad[start : start + ctx.width]
        return mine[: ctx.rows], None, None, None


def gather_rows(local: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[n, ...] rows on each rank of `group` (n <= width) -> [size * width, ...]: every rank's
    rows, each padded with zeros to `width`, rank by rank; differentiable (`_GatherKeys`: one
    all_gather forward, the gradient summed over the group backward)."""
    return _GatherKeys.apply(local, width, group)


def gather_keys(
    key: torch.Tensor,
    value: torch.Tensor,
    width: int,
    group: dist.ProcessGroup,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [T_local, b, groups, d] of this rank -> [cp * width, b, groups, d] of
    every rank of `group`, or their rows at `order` [T] (`_GatherKeys`): one collective and
    one gather for both (side by side along the head dim)."""
    both = _GatherKeys.apply(torch.cat([key, value], dim=-1), width, group, order)
    key, value = both.split([key.shape[-1], value.shape[-1]], -1)
    return key.contiguous(), value.contiguous()
