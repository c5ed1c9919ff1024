"""Random `RowCopies` plans and the float64 reference the row-copy tests share."""

from __future__ import annotations

import torch

from mtprun.kernels.row_copies import RowCopies


def random_plan(rows: int, k: int, seed: int, device: str = "cpu") -> RowCopies:
    """`rows` source rows with 0..k copies each (some none), destinations shuffled, the -1
    slots scattered among the taken ones."""
    g = torch.Generator().manual_seed(seed)
    copies = torch.randint(0, k + 1, (rows,), generator=g)
    if rows:
        copies[torch.randint(0, rows, (max(rows // 5, 1),), generator=g)] = 0
    total = int(copies.sum())
    destinations = torch.randperm(total, generator=g)
    slots = torch.full((rows, k), -1, dtype=torch.int64)
    sources = torch.empty(total, dtype=torch.int64)
    start = 0
    for n, count in enumerate(copies.tolist()):
        where = torch.randperm(k, generator=g)[:count]
        slots[n, where] = destinations[start : start + count]
        sources[destinations[start : start + count]] = n
        start += count
    return RowCopies(sources.to(device), slots.to(device))


def reference_sum(y: torch.Tensor, plan: RowCopies) -> torch.Tensor:
    """Row n: the float64 sum of y's rows in plan.slots[n], a loop over rows."""
    y = y.detach().double().cpu()
    out = torch.zeros(plan.slots.shape[0], y.shape[1], dtype=torch.float64)
    for n, row in enumerate(plan.slots.cpu().tolist()):
        for slot in row:
            if slot >= 0:
                out[n] += y[slot]
    return out
