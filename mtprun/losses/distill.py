"""Distillation: soft cross-entropy -sum(q log p) to the teacher's tempered distribution
q = softmax(teacher_logits / temperature); d/dz = p - q. The student is not tempered, so the
gradient keeps the fused form (a = 1, d = -1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from mtprun.losses.kind import TermConfig, TritonCall, TritonRow, UnfusedCost
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.losses.triton_jit import jit, tl

if TYPE_CHECKING:
    import torch


class DistillTerm(TermConfig):
    """Soft cross-entropy (forward KL up to a constant) to a teacher's tempered distribution."""

    kind: Literal["distill"] = Field("distill", description="Term kind.")
    teacher: str = Field(..., description="HF folder of the teacher model.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of the teacher.")


CONFIG = DistillTerm


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


def unfused_cost(term: DistillTerm) -> UnfusedCost:
    return UnfusedCost(buffers=3, reductions=5)


def describe(term: DistillTerm) -> tuple[str, str] | None:
    return None


@jit
def _triton_row(w, row, stats, token_inputs, params, a, b, c, d, OPTIONS: tl.constexpr):
    lse, _, _, teacher_cross, teacher_sumexp = stats
    # d(-sum q log p)/dz = p - q for a detached teacher q
    return a + w, b, c, d - w, (lse - teacher_cross / teacher_sumexp,)


SOFT_CE = "soft_ce"
"""The value column of -sum q log p (its row's weight column too), MTP's soft target's too."""
TRITON_ROW = TritonRow(
    name=SOFT_CE, function=_triton_row, values=(SOFT_CE,), per_token=SOFT_CE, teacher=True
)


def triton(term: DistillTerm, *, has_old: bool, has_ref: bool) -> TritonCall:
    return TritonCall(TRITON_ROW)
