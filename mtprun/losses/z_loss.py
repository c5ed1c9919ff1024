"""z-loss: value lse^2, d/dz = 2 lse p."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mtprun.losses.kind import TermConfig, TritonCall, TritonRow, UnfusedCost
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.losses.triton_jit import jit, tl


class ZLossTerm(TermConfig):
    """lse^2 penalty that keeps the softmax normaliser near 1 (PaLM)."""

    kind: Literal["z_loss"] = Field("z_loss", description="Term kind.")
    weight: float = Field(1e-4, ge=0, description="Multiplier of lse^2 in the summed loss.")


CONFIG = ZLossTerm


def needs(term: ZLossTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE})


def metric_names(term: ZLossTerm) -> tuple[str, ...]:
    return ("z_loss",)


def row_loss(term: ZLossTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    return RowLoss(value=stats.lse.square(), grad=GradCoeffs(a=2 * stats.lse))


def unfused_cost(term: ZLossTerm) -> UnfusedCost:
    return UnfusedCost(buffers=1, reductions=2)


def describe(term: ZLossTerm) -> tuple[str, str] | None:
    return None


@jit
def _triton_row(w, row, stats, token_inputs, params, a, b, c, d, OPTIONS: tl.constexpr):
    lse, _, _, _, _ = stats
    # d(lse^2)/dz = 2 lse p
    return a + 2.0 * w * lse, b, c, d, (lse * lse,)


TRITON_ROW = TritonRow(name="z_loss", function=_triton_row, values=("z_loss",), per_token="z_loss")


def triton(term: ZLossTerm, *, has_old: bool, has_ref: bool) -> TritonCall:
    return TritonCall(TRITON_ROW)
