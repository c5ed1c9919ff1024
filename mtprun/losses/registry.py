"""The loss kinds: one unit module each (see mtprun.losses.kind for what a unit provides).

`UNITS` is the only list of kinds; the recipe union, the kind names, the row math dispatch
and the Triton row functions are derived from it. A new kind is a new unit appended here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Annotated, Union

from pydantic import Field

from mtprun.losses import ce, distill, entropy, grpo, mtp, z_loss
from mtprun.losses.kind import TritonCall, TritonRow, UnfusedCost
from mtprun.losses.router import TRUNK_CONFIGS, TrunkTermConfig
from mtprun.losses.rows import RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat

UNITS: tuple[ModuleType, ...] = (ce, z_loss, grpo, entropy, distill, mtp)
KINDS: tuple[str, ...] = tuple(unit.CONFIG.model_fields["kind"].default for unit in UNITS)

LossTerm = Annotated[
    Union[tuple(unit.CONFIG for unit in UNITS)],  # noqa: UP007 (a union built from the units)
    Field(discriminator="kind"),
]
"""A head term: the union of the units' configs (what the fused head kernel computes)."""

TRUNK_KINDS: tuple[str, ...] = tuple(c.model_fields["kind"].default for c in TRUNK_CONFIGS)
"""Kinds of the trunk losses (`mtprun.losses.router`): recipe terms the head never sees."""

RecipeTerm = Annotated[
    Union[tuple(unit.CONFIG for unit in UNITS) + TRUNK_CONFIGS],  # noqa: UP007
    Field(discriminator="kind"),
]
"""One item of a recipe's `losses:` list: a head term or a trunk term."""


def is_trunk_term(term: object) -> bool:
    """Whether a `losses:` item is a trunk term (not compiled into the head plan)."""
    return isinstance(term, TrunkTermConfig)


TRITON_ROWS: tuple[TritonRow, ...] = tuple(u.TRITON_ROW for u in UNITS if u.TRITON_ROW)
"""Every Triton row function, in unit order (the order the kernel adds their coefficients)."""

_BY_KIND: dict[str, ModuleType] = dict(zip(KINDS, UNITS, strict=True))


def unit_of(term: LossTerm) -> ModuleType:
    """The unit module of `term`'s kind."""
    return _BY_KIND[term.kind]


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
