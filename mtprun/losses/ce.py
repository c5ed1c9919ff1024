"""Cross-entropy: value lse - z_y, d/dz = p - e_y."""

from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.spec.losses import CETerm


def needs(term: CETerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.TARGET_LOGIT})


def metric_names(term: CETerm) -> tuple[str, ...]:
    return ("ce",)


def row_loss(term: CETerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    ones = stats.lse.new_ones(())
    return RowLoss(value=-stats.logprob, grad=GradCoeffs(a=ones, b=-ones))
