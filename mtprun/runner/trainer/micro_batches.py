"""What a trainer rank reads off, and adds to, its micro batches of a step before it trains
them."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mtprun.data.batch import PackedBatch


def trained_sequences(batch: PackedBatch) -> int:
    """Sequences of the packed row with at least one trained token."""
    bounds = batch.cu_seqlens.long()
    trained = batch.loss_mask.long().cumsum(0)
    trained_before = torch.cat([trained.new_zeros(1), trained])
    return int((trained_before[bounds[1:]] > trained_before[bounds[:-1]]).sum())


def as_many_as_expert_ranks(
    micro_batches: list[PackedBatch], group: dist.ProcessGroup, device: torch.device
) -> list[PackedBatch]:
    """`micro_batches`, then as many copies of the last one without trained tokens as the
    expert-parallel `group`'s busiest rank has more micro batches (one small all-reduce).

    The ranks of an expert-parallel group are different data-parallel replicas, each with its
    own micro batches, and they exchange tokens at every MoE layer of every micro batch: one
    that ran out would leave the others waiting for it. The balancer gives every replica as
    many micro batches where their sequences allow (`mtprun.data.balance`), not always. The
    copies train nothing: the trainer runs them at weight 0 and leaves their routing out of
    its metrics."""
    most = torch.tensor([len(micro_batches)], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    last = micro_batches[-1]
    filler = dataclasses.replace(last, loss_mask=torch.zeros_like(last.loss_mask))
    return micro_batches + [filler] * (int(most) - len(micro_batches))
