"""The collectives of the vocab-parallel head loss (one per pass).

Forward: each rank holds the statistics of its vocab shard for every row of every group.
They are exchanged with ONE all_gather of a packed [rows, K] float64 tensor per rank (all
groups concatenated), and every rank merges the tp partials itself in rank order. An
all_reduce would need the global max first (a second collective, since a sum of exp(z - m)
is only additive once every rank uses the same m); gathering the partials instead carries
each rank's own max, so one collective suffices. It costs tp x rows x K numbers, K <= 12 + 3k
(k of a top-k MTP target): negligible next to the logits it replaces.

Backward: grad_hidden (and grad_mtp_hidden) are partial sums over this rank's vocab shard and
are summed with ONE all_reduce of all of them packed together. `head_loss` therefore takes
the place of Megatron's column-parallel output layer including the all-reduce in its input's
backward: pass it hidden states that did NOT go through `copy_to_tensor_model_parallel_region`
(the layer's own forward), or the gradient is summed twice. The weight gradient stays local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtprun.kernels.online_stats import PartialStats, StatsSpec, merge


def exchange_stats(
    partials: list[PartialStats], specs: list[StatsSpec], group: dist.ProcessGroup | None
) -> list[PartialStats]:
    """Merge every group's partial statistics over the ranks of `group` (one all_gather)."""
    if group is None or dist.get_world_size(group) == 1:
        return partials
    packed = [p.pack() for p in partials]
    flat = torch.cat([p.flatten() for p in packed])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    merged = []
    offset = 0
    for shape, spec in zip((p.shape for p in packed), specs, strict=True):
        size = shape[0] * shape[1]
        ranks = [PartialStats.unpack(g[offset : offset + size].view(shape), spec) for g in gathered]
        offset += size
        total = ranks[0]
        for other in ranks[1:]:
            total = merge(total, other)
        merged.append(total)
    return merged


def all_reduce_grads(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum the hidden-state gradients over the ranks of `group` in place (one all_reduce)."""
    if group is None or dist.get_world_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
