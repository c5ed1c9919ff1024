"""The loss kinds: one unit module each (`mtprun.losses.kind.LossUnit` says what a unit
provides).

`UNITS` is the extension point and its module list the only list of kinds; the recipe union,
the kind names, the row math dispatch and the Triton row functions are derived from it. A new
kind is a new unit module plus its line here. The units are imported here, at import of this
module (the spec layer needs the union of their configs at once; they import no torch).
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from mtprun.losses.kind import LossUnit, TritonCall, TritonRow, UnfusedCost, kind_of
from mtprun.losses.router import TRUNK_CONFIGS, TrunkTermConfig
from mtprun.losses.rows import RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.units import Units, register_point

UNITS: Units[LossUnit] = register_point(
    Units(
        "loss kind",
        LossUnit,
        (
            "mtprun.losses.ce",
            "mtprun.losses.z_loss",
            "mtprun.losses.grpo",
            "mtprun.losses.entropy",
            "mtprun.losses.distill",
            "mtprun.losses.mtp",
        ),
        name=kind_of,
    )
)
"""The loss kinds, in the order the Triton kernel adds their coefficients."""

KINDS: tuple[str, ...] = UNITS.names()

LossTerm = Annotated[
    Union[tuple(unit.CONFIG for unit in UNITS.units)],  # noqa: UP007 (a union built from the units)
    Field(discriminator="kind"),
]
"""A head term: the union of the units' configs (what the fused head kernel computes)."""

TRUNK_KINDS: tuple[str, ...] = tuple(c.model_fields["kind"].default for c in TRUNK_CONFIGS)
"""Kinds of the trunk losses (`mtprun.losses.router`): recipe terms the head never sees."""

RecipeTerm = Annotated[
    Union[tuple(unit.CONFIG for unit in UNITS.units) + TRUNK_CONFIGS],  # noqa: UP007
    Field(discriminator="kind"),
]
"""One item of a recipe's `losses:` list: a head term or a trunk term."""


def is_trunk_term(term: object) -> bool:
    """Whether a `losses:` item is a trunk term (not compiled into the head plan)."""
    return isinstance(term, TrunkTermConfig)


TRITON_ROWS: tuple[TritonRow, ...] = tuple(u.TRITON_ROW for u in UNITS.units if u.TRITON_ROW)
"""Every Triton row function, in unit order (the order the kernel adds their coefficients)."""


def unit_of(term: LossTerm) -> LossUnit:
    """The unit module of `term`'s kind."""
    return UNITS.by_name[term.kind]


def needs(term: LossTerm) -> frozenset[Stat]:
    """Per-row statistics `term` needs from the vocab pass."""
    return unit_of(term).needs(term)


def metric_names(term: LossTerm) -> tuple[str, ...]:
    """Metric names `term` reports (besides the always-present "entropy")."""
    return unit_of(term).metric_names(term)


def row_loss(term: LossTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    """`term`'s per-token value, gradient coefficients and metrics on rows with `stats`."""
    return unit_of(term).row_loss(term, stats, inputs)


def unfused_cost(term: LossTerm) -> UnfusedCost:
    """What `term` costs computed on its own by eager PyTorch (compiler.estimate)."""
    return unit_of(term).unfused_cost(term)


def describe(term: LossTerm) -> tuple[str, str] | None:
    """A (label, text) row of `mtprun plan`'s overview for `term`, or None."""
    return unit_of(term).describe(term)


def triton(term: LossTerm, *, has_old: bool, has_ref: bool) -> TritonCall:
    """What the Triton kernel runs for `term`, given which per-token inputs exist."""
    return unit_of(term).triton(term, has_old=has_old, has_ref=has_ref)
