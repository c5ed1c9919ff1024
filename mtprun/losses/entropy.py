"""Entropy bonus: value -H with H = lse - sum(p z); d(-H)/dz = p (z - lse + H).

The "entropy" metric (token-mean H) is reported for every plan, with or without this term.
"""

from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.spec.losses import EntropyTerm


def needs(term: EntropyTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.EXPECTED_LOGIT})


def metric_names(term: EntropyTerm) -> tuple[str, ...]:
    return ("entropy",)


def row_loss(term: EntropyTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    # p (z - lse + H) = p (z - max) + (max - lse + H) p
    shift = stats.max - stats.lse + stats.entropy
    return RowLoss(value=-stats.entropy, grad=GradCoeffs(a=shift, c=stats.lse.new_ones(())))
