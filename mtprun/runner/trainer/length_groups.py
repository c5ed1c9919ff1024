"""A packed row's causal attention as a few SDPA calls on padded batches of like-length
sequences: cuDNN's fused attention (Hopper) for rows FlexAttention would otherwise take.

A grouping at padding limit r puts the row's sequences, longest first, into groups: a
sequence joins the open group while the group padded to its longest member does at most r
times the causal work of its sequences unpadded (count * length^2 <= r * sum(L_i^2)), else
it opens a group of its own. `LengthGroups.of` takes, of the groupings at LIMITS, the one of
least estimated time: padded work sum(count * length^2), plus CALL_WORK a group, plus
GATHER_WORK a token when the groups' slots are not the row itself (a gather of q, k, v and
the output, and their backwards). Sequences of a few thousand tokens fill the GPU alone and
run best one call each, straight on the row; many short ones run best in a few padded
groups. `grouped_attention` then runs one causal SDPA per group on its
[count, heads, length, d] batch. Padding slots sit after their sequence's real tokens, so
causal attention never shows them to a real query; their own outputs are dropped, so they
receive no gradient and give none (zero output gradient: zero dS and zero dV).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from mtprun.data.device_copy import to_device

# Padding limits of the groupings `LengthGroups.of` weighs (0: every sequence alone).
LIMITS = (0.0, 1.25, 1.5)
# One more SDPA call (forward + backward: launches, a partial last wave), in causal work
# units L^2: 0.19 ms on an H200 at 16 query / 8 key-value heads of 128, where a lone
# 16384-token sequence does 36M units a millisecond (bench/RESULTS.md, run 98).
CALL_WORK = 7e6
# Gathering a token into the groups' slots and its output back, forward and backward
# (~1.4 ms for a 16k-token row there), in the same units.
GATHER_WORK = 3000.0


def _groups(lengths: list[int], limit: float) -> list[list[int]]:
    """Sequence indices grouped longest first at padding limit `limit`, each group in row
    order, the groups in the row order of their first sequence."""
    groups: list[list[int]] = []
    longest = work = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n == 0:  # no tokens: no group (a call on an empty batch is not every kernel's)
            continue
        if groups and (len(groups[-1]) + 1) * longest**2 <= limit * (work + n * n):
            groups[-1].append(i)
            work += n * n
        else:
            groups.append([i])
            longest, work = n, n * n
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _shapes(lengths: list[int], groups: list[list[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((len(g), max(lengths[i] for i in g)) for g in groups)


def _is_the_row(lengths: list[int], groups: list[list[int]]) -> bool:
    """Whether the groups' slots are the row: no padding, sequences in row order."""
    order = [i for g in groups for i in g]
    return order == sorted(order) and all(lengths[i] == lengths[g[0]] for g in groups for i in g)


def _estimated_work(lengths: list[int], groups: list[list[int]]) -> float:
    padded = sum(count * length**2 for count, length in _shapes(lengths, groups))
    gathered = 0.0 if _is_the_row(lengths, groups) else GATHER_WORK * sum(lengths)
    return padded + CALL_WORK * len(groups) + gathered


@dataclass(frozen=True)
class LengthGroups:
    """The groups' batch shapes (count, length) in order, and how the row maps onto their
    slots, the groups' [count * length] batches laid end to end. `gather` [slots]: the row
    position each slot reads (padding reads position 0); `scatter` [T]: each row token's
    slot. Both None when the slots are the row itself (no padding, sequences in row order),
    as for a row of equal sequences or of sequences each alone."""

    shapes: tuple[tuple[int, int], ...]
    gather: torch.Tensor | None
    scatter: torch.Tensor | None

    @classmethod
    def of(cls, lengths: list[int], device: Any, limit: float | None = None) -> LengthGroups:
        """The grouping at padding limit `limit`, or with None the one of LIMITS of least
        estimated work."""
        limits = LIMITS if limit is None else (limit,)
        groups = min((_groups(lengths, r) for r in limits), key=partial(_estimated_work, lengths))
        shapes = _shapes(lengths, groups)
        if _is_the_row(lengths, groups):
            return cls(shapes, None, None)
        starts = [0, *accumulate(lengths)][:-1]
        gather, scatter, slot = [], torch.empty(sum(lengths), dtype=torch.long), 0
        for g, (_, length) in zip(groups, shapes, strict=True):
            for i in g:
                n, start = lengths[i], starts[i]
                gather.append(torch.arange(start, start + n))
                gather.append(torch.zeros(length - n, dtype=torch.long))
                scatter[start : start + n] = torch.arange(slot, slot + n)
                slot += length
        return cls(shapes, to_device(torch.cat(gather), device), to_device(scatter, device))


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: LengthGroups
) -> torch.Tensor:
    """[T, 1, heads, d] query, [T, 1, groups, d] keys/values -> [T, 1, heads * dv]: causal
    SDPA on each group's [count, heads, length, d] batch (GQA by the kernel). One gather of
    q, k and v into the groups' slots and one of the outputs back (their backwards one
    index_add each), none when the slots are the row."""
    q, k, v = (t.squeeze(1) for t in (query, key, value))
    if groups.gather is not None:
        q, k, v = (t.index_select(0, groups.gather) for t in (q, k, v))
    sizes = [count * length for count, length in groups.shapes]
    outs = []
    for (count, length), qg, kg, vg in zip(
        groups.shapes, q.split(sizes), k.split(sizes), v.split(sizes), strict=True
    ):
        qg, kg, vg = (t.view(count, length, *t.shape[1:]).transpose(1, 2) for t in (qg, kg, vg))
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        outs.append(out.transpose(1, 2).flatten(0, 1))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    if groups.scatter is not None:
        out = out.index_select(0, groups.scatter)
    return out.flatten(1).unsqueeze(1)
