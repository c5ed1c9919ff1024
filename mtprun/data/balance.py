"""Sequence balancing across data-parallel replicas: each step's sequences split into dp groups
of near-equal compute, then each group packed into micro batches of at most a token budget.

Cost of a sequence of L tokens (forward and backward scale alike, so one constant covers both):

    cost(L) = L * (a + L)

A decoder layer's matmuls cost 2 * P_layer FLOPs per token (P_layer: the weights a token
multiplies, `active` experts only), linear in L; causal attention's QK^T and AV cost
2 * L^2 * d (d = heads * head_dim: L^2/2 query-key pairs, 2 FLOPs per multiply-add, two
products). Per layer that is 2 d L (P_layer / d + L), and the output layer adds 2 H V per
token, so over the model

    a = (layers * P_layer + H * V) / (layers * d)       (`linear_length`)

the length at which attention's quadratic term equals the linear FLOPs (Qwen3-1.7B: ~30k
tokens, so a 16k response costs ~1.5x its length's share). Without a shape, a = 8192.

Partition: k-way Karmarkar-Karp largest differencing (as verl's `balance_batch`): every
sequence starts as a k-tuple of subsets (itself and k-1 empty ones); the two tuples with the
largest spread (max - min subset cost) are merged, pairing one's costliest subset with the
other's cheapest, until one tuple is left. With `equal_size` the tuples start as k
sequences of similar cost, one per subset, so every group gets n/k of them (ceil or floor).

Packing: per group, first-fit decreasing by tokens into micro batches of at most `budget`
tokens. Every replica then gets the same number of micro batches where its sequences allow:
a replica with fewer splits its fullest micro batch in two (its sequences dealt greedily by
tokens) until it has as many; when one replica has too few sequences for that, the groups
are drawn again with equal sizes first.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtprun.data.batch import PackedBatch
    from mtprun.models.shape import ModelShape

DEFAULT_LINEAR_LENGTH = 8192.0


def linear_length(shape: ModelShape | None) -> float:
    """`a` of cost(L) = L (a + L) for `shape` (see the module docstring); DEFAULT_LINEAR_LENGTH
    without a shape."""
    if shape is None:
        return DEFAULT_LINEAR_LENGTH
    h, d = shape.hidden, shape.heads * shape.head_dim
    attention = 2 * h * d + 2 * h * shape.kv_heads * shape.head_dim
    if shape.experts is None:
        mlp = 3 * h * shape.intermediate
    else:
        e = shape.experts
        mlp = 3 * h * (e.top_k * e.intermediate + e.shared_intermediate)
    return (shape.layers * (attention + mlp) + h * shape.vocab) / (shape.layers * d)


def sequence_cost(length: int, a: float) -> float:
    """cost(L) = L (a + L): the linear FLOPs plus causal attention's quadratic term."""
    return length * (a + length)


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `costs` in k groups of near-equal total cost (largest differencing; with
    `equal_size` each group holds floor or ceil of n/k items). Groups list indices ascending;
    the groups are ordered by decreasing cost."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    order = sorted(range(len(costs)), key=lambda i: costs[i])
    # A state: its k subsets as (cost, indices), costliest first. The heap pops the largest
    # spread first; `tie` keeps the order of equal spreads deterministic.
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    if equal_size:
        padded: list[int | None] = [None] * (-len(order) % k) + list(order)  # None: no item
        chunks = [padded[s : s + k] for s in range(0, len(padded), k)]
    else:
        chunks = [[i] + [None] * (k - 1) for i in order]
    for tie, chunk in enumerate(chunks):
        subsets = [(0.0 if i is None else float(costs[i]), [] if i is None else [i]) for i in chunk]
        subsets.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), tie, subsets))
    tie = len(chunks)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [
            (c1 + c2, i1 + i2) for (c1, i1), (c2, i2) in zip(first, reversed(second), strict=True)
        ]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(indices) for _, indices in heap[0][2]]


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `budget` tokens: longest first, each into the
    first bin it fits. Every length must be at most `budget`."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens exceeds the budget {budget}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


@dataclass
class Layout:
    """micro_batches[j]: the indices of the sequences packed into micro batch j (in order);
    replica_of[j]: the data-parallel replica that trains it; costs: each replica's total cost."""

    micro_batches: list[list[int]]
    replica_of: list[int]
    costs: list[float]


def balanced_layout(lengths: Sequence[int], dp: int, budget: int, a: float) -> Layout:
    """The step's sequences (`lengths` in tokens) split over `dp` replicas by cost, each
    replica's packed first-fit decreasing into micro batches of at most `budget` tokens and
    as many micro batches per replica as its sequences allow (see the module docstring).
    Micro batches are listed replica by replica."""
    if len(lengths) < dp:
        raise ValueError(
            f"{len(lengths)} sequences for {dp} data-parallel replicas: raise the batch "
            "(task.prompts_per_step)"
        )
    costs = [sequence_cost(n, a) for n in lengths]
    groups = karmarkar_karp(costs, dp)
    bins = [_pack_group(g, lengths, budget) for g in groups]
    most = max(len(b) for b in bins)
    if any(len(g) < most for g in groups):
        groups = karmarkar_karp(costs, dp, equal_size=True)
        bins = [_pack_group(g, lengths, budget) for g in groups]
        most = max(len(b) for b in bins)
    for replica in bins:
        _split_to(replica, most, lengths)
    return Layout(
        micro_batches=[mb for replica in bins for mb in replica],
        replica_of=[d for d, replica in enumerate(bins) for _ in replica],
        costs=[sum(costs[i] for i in g) for g in groups],
    )


def _pack_group(group: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    local = first_fit_decreasing([lengths[i] for i in group], budget)
    return [sorted(group[j] for j in b) for b in local]


def _split_to(bins: list[list[int]], count: int, lengths: Sequence[int]) -> None:
    """Split the fullest bins (of two or more sequences) in two until there are `count`."""
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            return
        fullest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        halves: tuple[list[int], list[int]] = ([], [])
        used = [0, 0]
        for i in sorted(fullest, key=lambda i: -lengths[i]):
            side = 0 if used[0] <= used[1] else 1
            halves[side].append(i)
            used[side] += lengths[i]
        bins.remove(fullest)
        bins.extend(sorted(h) for h in halves)


def rebalance(
    batches: Sequence[PackedBatch], dp: int, budget: int, a: float
) -> tuple[list[PackedBatch], Layout]:
    """The sequences of `batches` repacked by `balanced_layout`: the new micro batches (the
    same sequences, each whole, with its own tokens, targets, masks and RL fields) and the
    layout that says which replica trains each."""
    from mtprun.data.packing import join, unpack

    sequences = unpack(batches)
    layout = balanced_layout([s.num_tokens for s in sequences], dp, budget, a)
    return [join([sequences[i] for i in mb]) for mb in layout.micro_batches], layout


def imbalance(costs: Sequence[float]) -> float:
    """The costliest replica's cost over the mean (1.0: perfectly even): the step time the
    slowest replica adds, under the cost model."""
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean > 0 else 1.0
