"""How the routed experts' tensors are split over expert-parallel ranks, and back.

Rank r of `ep` holds experts [r E/ep, (r + 1) E/ep) of every sparse layer: dim 0 of
`experts.weight1` / `experts.weight2` (`mtprun.models.moe`). Every other tensor (attention,
router, shared expert, dense layers) is the same on each expert-parallel rank: those ranks
are data-parallel replicas for it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

_EXPERTS = ("mlp.experts.weight1", "mlp.experts.weight2")


def is_expert(name: str) -> bool:
    """Whether `name` is a routed-experts tensor (split over expert-parallel ranks)."""
    return name.endswith(_EXPERTS)


def held_experts(count: int, rank: int, ep: int) -> range:
    """The experts of `count` (a sparse layer's) that expert-parallel rank `rank` of `ep` holds."""
    per_rank = count // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def gather_state_dict(
    local: Mapping[str, torch.Tensor],
    ep: int,
    group: torch.distributed.ProcessGroup | None,
    root_only: bool = False,
) -> dict:
    """Every expert of each routed-experts tensor, all-gathered over `group` in rank order;
    the rest unchanged (inverse of converting rank by rank, `held_experts`). With
    `root_only` the experts go to the group's first rank alone (a gather); the others get {}."""
    full = dict(local)
    for name, t in local.items():
        if ep > 1 and is_expert(name):
            full[name] = gather_experts(t, ep, group, root_only)
    root = ep == 1 or not root_only or torch.distributed.get_rank(group) == 0
    return full if root else {}


def gather_experts(
    t: torch.Tensor, ep: int, group: torch.distributed.ProcessGroup | None, root_only: bool
) -> torch.Tensor | None:
    """Every rank's experts of one routed-experts tensor, in rank order (a collective over
    `group`); with `root_only` on the group's first rank alone (None elsewhere)."""
    root = not root_only or torch.distributed.get_rank(group) == 0
    mine = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(ep)] if root else None
    if root_only:
        torch.distributed.gather(mine, parts, group=group, group_dst=0)
    else:
        torch.distributed.all_gather(parts, mine, group=group)
    return torch.cat(parts) if root else None
