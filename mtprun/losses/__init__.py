"""The loss kinds, one unit module per `kind` (mtprun.losses.kind says what a unit provides;
mtprun.losses.registry lists them). This package sits below the spec layer: the recipe's
`losses:` union is built from the units' configs."""

from __future__ import annotations

from mtprun.losses.kind import LossAgg, TermConfig
from mtprun.losses.registry import (
    KINDS,
    TRUNK_KINDS,
    LossTerm,
    RecipeTerm,
    describe,
    is_trunk_term,
    metric_names,
    needs,
    row_loss,
    triton,
    unfused_cost,
    unit_of,
)
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat

__all__ = [
    "KINDS",
    "TRUNK_KINDS",
    "GradCoeffs",
    "LossAgg",
    "LossTerm",
    "RecipeTerm",
    "RowInputs",
    "RowLoss",
    "RowStats",
    "Stat",
    "TermConfig",
    "describe",
    "is_trunk_term",
    "metric_names",
    "needs",
    "row_loss",
    "triton",
    "unfused_cost",
    "unit_of",
]
