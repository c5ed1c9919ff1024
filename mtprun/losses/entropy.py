"""Entropy H = lse - sum(p z); d(-coef H)/dz = coef p (z - lse + H)... sign handled in math."""

from mtprun.losses.stats import Stat
from mtprun.spec.losses import EntropyTerm


def needs(term: EntropyTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.EXPECTED_LOGIT})


def metric_names(term: EntropyTerm) -> tuple[str, ...]:
    return ("entropy",)
