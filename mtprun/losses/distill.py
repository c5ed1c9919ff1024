"""Distillation: soft cross-entropy -sum(q log p) to the teacher's tempered distribution
q = softmax(teacher_logits / temperature); d/dz = p - q. The student is not tempered, so the
gradient keeps the fused form (a = 1, d = -1)."""

import torch

from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.spec.losses import DistillTerm


def needs(term: DistillTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.TEACHER_LSE, Stat.TEACHER_CROSS})


def metric_names(term: DistillTerm) -> tuple[str, ...]:
    return ("distill",)


def row_loss(term: DistillTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    return RowLoss(value=soft_cross_entropy(stats), grad=soft_grad(stats))


def soft_cross_entropy(stats: RowStats) -> torch.Tensor:
    """-sum_v q_v log p_v = (lse - max) - sum_v q_v (z_v - max)."""
    return (stats.lse - stats.max) - stats.teacher_cross


def soft_grad(stats: RowStats) -> GradCoeffs:
    ones = stats.lse.new_ones(())
    return GradCoeffs(a=ones, d=-ones)
