"""Distillation: soft cross-entropy to a teacher's tempered distribution, d/dz = s - q."""

from mtprun.losses.stats import Stat
from mtprun.spec.losses import DistillTerm


def needs(term: DistillTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.TEACHER_LSE, Stat.TEACHER_CROSS})


def metric_names(term: DistillTerm) -> tuple[str, ...]:
    return ("distill",)
