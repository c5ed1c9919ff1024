"""Entropy bonus: value -H with H = lse - sum(p z); d(-H)/dz = p (z - lse + H).

The "entropy" metric (token-mean H) is reported for every plan, with or without this term.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mtprun.losses.kind import LossAgg, TritonCall, TritonRow, UnfusedCost
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.losses.triton_jit import jit, tl


class EntropyTerm(BaseModel):
    """Entropy of the policy: always reported as a metric; a bonus -coef*H when coef > 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["entropy"] = Field("entropy", description="Term kind.")
    coef: float = Field(0.0, ge=0, description="Entropy bonus; 0 reports the metric only.")
    loss_agg: LossAgg = Field(
        "token-mean", description="How per-token entropies become one number."
    )

    @property
    def weight(self) -> float:
        return self.coef


CONFIG = EntropyTerm


def needs(term: EntropyTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.EXPECTED_LOGIT})


def metric_names(term: EntropyTerm) -> tuple[str, ...]:
    return ("entropy",)


def row_loss(term: EntropyTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    # p (z - lse + H) = p (z - max) + (max - lse + H) p
    shift = stats.max - stats.lse + stats.entropy
    return RowLoss(value=-stats.entropy, grad=GradCoeffs(a=shift, c=stats.lse.new_ones(())))


def unfused_cost(term: EntropyTerm) -> UnfusedCost:
    return UnfusedCost(buffers=2, reductions=3)


def describe(term: EntropyTerm) -> tuple[str, str] | None:
    return None


@jit
def _triton_row(w, row, stats, token_inputs, params, a, b, c, d, OPTIONS: tl.constexpr):
    (BONUS,) = OPTIONS
    lse, _, entropy, _, _ = stats
    if BONUS:
        # d(-H)/dz = p (z - lse + H)
        a += w * (entropy - lse)
        c += w
    return a, b, c, d, ()


TRITON_ROW = TritonRow(name="entropy", function=_triton_row, per_token="entropy", negate=True)


def triton(term: EntropyTerm, *, has_old: bool, has_ref: bool) -> TritonCall:
    """The bonus's gradient only when coef > 0 (the metric is the kernel's entropy column)."""
    return TritonCall(TRITON_ROW, options=(term.coef > 0,))
