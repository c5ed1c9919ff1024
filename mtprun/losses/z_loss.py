"""z-loss: value lse^2, d/dz = 2 lse p."""

from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.spec.losses import ZLossTerm


def needs(term: ZLossTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE})


def metric_names(term: ZLossTerm) -> tuple[str, ...]:
    return ("z_loss",)


def row_loss(term: ZLossTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    return RowLoss(value=stats.lse.square(), grad=GradCoeffs(a=2 * stats.lse))
