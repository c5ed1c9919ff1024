"""Cross-entropy: value lse - z_y, d/dz = p - e_y."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mtprun.losses.kind import TermConfig, TritonCall, TritonRow, UnfusedCost
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.losses.triton_jit import jit, tl


class CETerm(TermConfig):
    """Cross-entropy to the next token."""

    kind: Literal["ce"] = Field("ce", description="Term kind.")


CONFIG = CETerm


def needs(term: CETerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.TARGET_LOGIT})


def metric_names(term: CETerm) -> tuple[str, ...]:
    return ("ce",)


def row_loss(term: CETerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    ones = stats.lse.new_ones(())
    return RowLoss(value=-stats.logprob, grad=GradCoeffs(a=ones, b=-ones))


def unfused_cost(term: CETerm) -> UnfusedCost:
    return UnfusedCost(buffers=1, reductions=3)


def describe(term: CETerm) -> tuple[str, str] | None:
    return None


@jit
def _triton_row(w, row, stats, token_inputs, params, a, b, c, d, OPTIONS: tl.constexpr):
    # d(lse - z_y)/dz = p - e_y
    return a + w, b - w, c, d, ()


TRITON_ROW = TritonRow(name="ce", function=_triton_row, per_token="logp", negate=True)


def triton(term: CETerm, *, has_old: bool, has_ref: bool) -> TritonCall:
    return TritonCall(TRITON_ROW)
