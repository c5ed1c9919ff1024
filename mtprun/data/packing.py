"""Sequence packing: rendered sequences back to back into `PackedBatch` rows.

The one shift of next-token training happens here: row t of a packed batch predicts token t+1
of the same sequence, so `targets[t]`, `loss_mask[t]` and `old_logprobs[t]` all describe token
t+1. The last token of each sequence has nothing to predict inside its sequence: its target is
`pad_id` and its loss_mask False, so no row ever learns across a sequence boundary (which MTP
heads rely on too: they read the boundaries from `cu_seqlens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from mtprun.data.batch import PackedBatch
from mtprun.data.mask import MaskPolicy, token_mask
from mtprun.data.render import RenderedSequence


def pack(
    sequences: Sequence[RenderedSequence],
    policy: MaskPolicy,
    packing_length: int,
    advantages: Sequence[float] | None = None,
    pad_id: int = 0,
) -> list[PackedBatch]:
    """Pack `sequences`, in order, into batches of at most `packing_length` tokens.

    A batch is closed when the next sequence does not fit. `advantages` (RL) holds one value
    per sequence, broadcast to its tokens; with it, every sequence must carry `logprobs`.
    """
    if advantages is not None and len(advantages) != len(sequences):
        raise ValueError(f"{len(advantages)} advantages for {len(sequences)} sequences")
    for i, seq in enumerate(sequences):
        if not 0 < len(seq) <= packing_length:
            raise ValueError(
                f"sequence {i} has {len(seq)} tokens; packing needs 1 to packing_length="
                f"{packing_length} tokens: raise data.packing_length or shorten the sequence"
            )
    batches = []
    for start, stop in bins([len(s) for s in sequences], packing_length):
        adv = None if advantages is None else advantages[start:stop]
        batches.append(_pack_bin(sequences[start:stop], policy, adv, pad_id))
    return batches


def bins(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges of consecutive sequences that fit in `capacity` tokens."""
    bins, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if used + n > capacity:
            bins.append((start, i))
            start, used = i, 0
        used += n
    if lengths:
        bins.append((start, len(lengths)))
    return bins


def _pack_bin(
    sequences: Sequence[RenderedSequence],
    policy: MaskPolicy,
    advantages: Sequence[float] | None,
    pad_id: int,
) -> PackedBatch:
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    last = cu_seqlens[1:].long() - 1

    input_ids = torch.cat([s.token_ids for s in sequences])
    targets = _shift_left(input_ids, last, pad_id)
    loss_mask = _shift_left(torch.cat([token_mask(s, policy) for s in sequences]), last, False)
    position_ids = torch.arange(len(input_ids)) - torch.repeat_interleave(
        cu_seqlens[:-1].long(), lengths
    )
    batch = PackedBatch(input_ids, targets, loss_mask, position_ids, cu_seqlens)
    if advantages is not None:
        if any(s.logprobs is None for s in sequences):
            raise ValueError("RL packing needs the sampling logprobs of every trajectory")
        logprobs = torch.cat([s.logprobs for s in sequences])
        batch.old_logprobs = _shift_left(logprobs, last, 0.0)
        batch.advantages = torch.repeat_interleave(
            torch.tensor(advantages, dtype=torch.float32), lengths
        )
    batch.routed_experts = _routed_experts(sequences)
    return batch


def _routed_experts(sequences: Sequence[RenderedSequence]) -> torch.Tensor | None:
    """The rollout engine's routing of every token (router replay), -1 rows for sequences
    without one; None when no sequence has one."""
    known = [s.routed_experts for s in sequences if s.routed_experts is not None]
    if not known:
        return None
    per_token = known[0].shape[1:]
    if any(r.shape[1:] != per_token for r in known):
        raise ValueError(
            "routings of different shapes in one batch: "
            f"{sorted({tuple(r.shape[1:]) for r in known})}"
        )
    return torch.cat(
        [
            s.routed_experts
            if s.routed_experts is not None
            else torch.full((len(s), *per_token), -1, dtype=torch.int16)
            for s in sequences
        ]
    )


def _shift_left(values: torch.Tensor, last: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
    """values[t+1] at t, with `fill` at each sequence's last position."""
    shifted = values.roll(-1)
    shifted[last] = fill
    return shifted


def unpack(batches: Sequence[PackedBatch]) -> list[PackedBatch]:
    """Every sequence of `batches`, in order, as a batch of its own (the inverse of `join`):
    each per-token field sliced at the sequence's bounds, positions and boundaries its own."""
    return [
        _slice(batch, int(start), int(stop))
        for batch in batches
        for start, stop in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True)
    ]


def join(parts: Sequence[PackedBatch]) -> PackedBatch:
    """`parts` back to back in one batch (their fields set alike: all or none per field)."""
    if not parts:
        raise ValueError("join needs at least one batch")
    values = {}
    for f in fields(PackedBatch):
        if f.name == "cu_seqlens":
            continue
        got = [getattr(p, f.name) for p in parts]
        if all(v is None for v in got):
            values[f.name] = None
        elif any(v is None for v in got):
            raise ValueError(f"{f.name} is set on some of the batches to join, not all")
        else:
            values[f.name] = torch.cat(got)
    lengths = [0] + [int(n) for p in parts for n in p.cu_seqlens[1:] - p.cu_seqlens[:-1]]
    cu_seqlens = torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedBatch(cu_seqlens=cu_seqlens, **values)


def _slice(batch: PackedBatch, start: int, stop: int) -> PackedBatch:
    values = {
        f.name: None if v is None else v[start:stop]
        for f in fields(PackedBatch)
        if f.name != "cu_seqlens"
        for v in [getattr(batch, f.name)]
    }
    cu_seqlens = torch.tensor([0, stop - start], dtype=torch.int32)
    return PackedBatch(cu_seqlens=cu_seqlens, **values)
