"""Cost model of the head loss for one micro batch: the fused plan against the unfused way.

Unfused means eager PyTorch computing each term on its own: logits [rows x vocab] are
materialised, every term keeps its own float32 full-vocab buffers for backward, and under
tensor parallelism every term makes its own vocab-parallel reductions. Fused means the plan:
one pass over vocab tiles, per-row statistics only, one statistics exchange. Estimates are
per tensor-parallel rank, head-loss buffers only (weights, optimizer state and the gradient
of the hidden states are the same both ways).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mtprun import losses
from mtprun.compiler.plan import HeadPlan
from mtprun.losses import Stat

FLOAT32 = 4
DEFAULT_VOCAB_TILE = 4096


@dataclass(frozen=True)
class HeadCost:
    rows: int  # tokens in the micro batch (all under the loss mask: an upper bound)
    hidden: int
    vocab: int
    padded_vocab: int  # a multiple of tp: each rank holds padded_vocab / tp output rows
    fused_bytes: int
    unfused_bytes: int
    fused_collectives: int  # per micro batch
    unfused_collectives: int
    vocab_passes: int = 1  # statistics pass; the backward pass rebuilds tiles, never a full row


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocab rounded up to a multiple of tp (padding rows get -inf logits)."""
    return math.ceil(vocab / tp) * tp


def estimate_head_cost(
    plan: HeadPlan,
    *,
    rows: int,
    hidden: int,
    vocab: int,
    param_bytes: int,
    vocab_tile: int = DEFAULT_VOCAB_TILE,
) -> HeadCost:
    """Cost of one micro batch of `rows` tokens through the head of `plan` (per TP rank)."""
    tp = plan.tp_size
    padded = padded_vocab(vocab, tp)
    shard = padded // tp
    # Policy rows plus one row per MTP head: head k is a second set of rows over the vocab.
    head_rows = rows * (1 + len(plan.mtp_depths))
    tile = min(vocab_tile, shard)
    fused = (
        head_rows * tile * FLOAT32 * 2  # a logits tile and its gradient tile
        + head_rows * _stat_width(plan) * FLOAT32
    )
    unfused = rows * shard * (param_bytes + FLOAT32)  # logits and their gradient
    costs = [losses.unfused_cost(t) for t in plan.terms]
    unfused += sum(c.buffers for c in costs) * rows * shard * FLOAT32
    return HeadCost(
        rows=rows,
        hidden=hidden,
        vocab=vocab,
        padded_vocab=padded,
        fused_bytes=fused,
        unfused_bytes=unfused,
        fused_collectives=0 if tp == 1 else 1 + (Stat.TEACHER_TOPK in plan.stats),
        unfused_collectives=0 if tp == 1 else sum(c.reductions for c in costs),
    )


def _stat_width(plan: HeadPlan) -> int:
    topk = max((getattr(t, "topk", None) or 0 for t in plan.terms), default=0)
    return len(plan.stats) + 2 * topk  # top-k keeps ids and logits
