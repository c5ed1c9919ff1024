"""The math of each loss term. One module per `kind`; each declares its per-row statistics
(`needs`), the metric names it reports (`metric_names`) and its math on those statistics
(`row_loss`: per-token value, gradient coefficients, per-token metrics)."""

from __future__ import annotations

from types import ModuleType

from mtprun.losses import ce, distill, entropy, grpo, mtp, z_loss
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.spec.losses import LossTerm

_MODULES: dict[str, ModuleType] = {
    "ce": ce,
    "z_loss": z_loss,
    "grpo": grpo,
    "entropy": entropy,
    "distill": distill,
    "mtp": mtp,
}


def module_for(term: LossTerm) -> ModuleType:
    return _MODULES[term.kind]


def needs(term: LossTerm) -> frozenset[Stat]:
    """Per-row statistics `term` needs from the vocab pass."""
    return module_for(term).needs(term)


def metric_names(term: LossTerm) -> tuple[str, ...]:
    """Metric names `term` reports (besides the always-present "entropy")."""
    return module_for(term).metric_names(term)


def row_loss(term: LossTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    """`term`'s per-token value, gradient coefficients and metrics on rows with `stats`."""
    return module_for(term).row_loss(term, stats, inputs)


__all__ = [
    "GradCoeffs",
    "RowInputs",
    "RowLoss",
    "RowStats",
    "Stat",
    "metric_names",
    "module_for",
    "needs",
    "row_loss",
]
