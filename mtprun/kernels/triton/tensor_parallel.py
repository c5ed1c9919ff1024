"""The one statistics exchange per chunk under vocab parallelism.

Each rank's kernel writes shard-local statistics (rows.STATS_COLUMNS); one all-gather moves
all of them at once, and every rank combines them into the global row statistics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_stats(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[R, 9] shard statistics -> [R, 9] statistics of the whole vocabulary (one collective)."""
    world = dist.get_world_size(group)
    gathered = local.new_empty((world, *local.shape))
    dist.all_gather(list(gathered.unbind(0)), local.contiguous(), group=group)
    return combine_stats(gathered)


def combine_stats(shards: torch.Tensor) -> torch.Tensor:
    """Combine [tp, R, 9] shard statistics (column order of rows.STATS_COLUMNS)."""
    m, s, sum_ez, target_logit, best_val, best_idx, t_m, t_s, cross = shards.unbind(-1)
    m_all = m.amax(0)
    scale = torch.exp(m - m_all)
    t_m_all = t_m.amax(0)
    t_scale = torch.exp(t_m - t_m_all).nan_to_num(0.0)  # no teacher: -inf - -inf
    # The first shard holding the max has the lowest global id: first-occurrence argmax.
    winner = best_val.argmax(0, keepdim=True)
    return torch.stack(
        (
            m_all,
            (s * scale).sum(0),
            (sum_ez * scale).sum(0),
            target_logit.sum(0),
            best_val.amax(0),
            best_idx.gather(0, winner).squeeze(0),
            t_m_all,
            (t_s * t_scale).sum(0),
            (cross * t_scale).sum(0),
        ),
        dim=-1,
    )


def all_reduce_(grad: torch.Tensor | None, group: dist.ProcessGroup) -> None:
    """Sum a replicated input's gradient over the shards' contributions."""
    if grad is not None:
        dist.all_reduce(grad, group=group)
