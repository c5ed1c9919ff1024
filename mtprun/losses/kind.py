"""What every loss-kind unit provides (one module per `kind` under mtprun/losses/): the
`LossUnit` protocol, checked on every registered unit by tests/test_units.py.

A unit module defines:

    CONFIG              its recipe config: a `TermConfig` subclass with `kind: Literal[...]`.
    needs(term)         the per-row statistics (`Stat`) it reads from the vocab pass.
    metric_names(term)  the metric names it reports (its own value under its kind first).
    row_loss(term, stats, inputs) -> RowLoss   its torch row math (mtprun.losses.rows).
    unfused_cost(term) -> UnfusedCost          what eager PyTorch would spend on it alone.
    describe(term)      a (label, text) row for `mtprun plan`, or None.
    TRITON_ROW          its Triton row function and columns (`TritonRow`), or None.
    triton(term, *, has_old, has_ref) -> TritonCall   what the Triton kernel runs for a term.

The registry (mtprun.losses.registry, a `mtprun.units.Units` point) lists the unit modules;
the recipe union, the kind list and the Triton column layout derive from it, and nothing
else lists the kinds.

Units import torch only for type checking (the spec layer, and so `mtprun validate`,
imports them for their configs); their Triton row functions take `jit` and `tl` from
mtprun.losses.triton_jit, so an install without triton still validates recipes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from mtprun.losses.rows import RowInputs, RowLoss, RowStats
    from mtprun.losses.stats import Stat

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class TermConfig(BaseModel):
    """Fields every loss term has: its weight in the summed loss and its aggregation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, ge=0, description="Multiplier of this term in the summed loss.")
    loss_agg: LossAgg = Field(
        "token-mean",
        description="How per-token values become one number: mean over the term's valid tokens "
        "(token-mean), mean over sequences of each sequence's token mean, or mean over sequences "
        "of the token sum divided by the longest sequence.",
    )


@dataclass(frozen=True)
class UnfusedCost:
    """What a term costs when eager PyTorch computes it on its own (compiler.estimate):
    float32 [rows x vocab] buffers kept for backward, and vocab-parallel all-reduces (max,
    sum of exp, gathers...) under tensor parallelism."""

    buffers: int
    reductions: int


@dataclass(frozen=True)
class TritonRow:
    """A Triton row function and the per-row columns it owns in the kernel's buffers.

    name:      its column of the [R, rows] weight matrix (the term's weight times its
               aggregation weight); the kernel hands that weight to `function` as `w`.
    function:  `@triton.jit (w, row, stats, token_inputs, params, a, b, c, d, OPTIONS)
               -> (a, b, c, d, values)`: adds its share of the logit-gradient coefficients
               (dz = a p + b e_y + c p z + d q) for one row. stats = (lse, logp, entropy,
               teacher_cross, teacher_sumexp); token_inputs = (advantages, old_logprobs,
               ref_logprobs, seq_log_ratio, is_weights) pointers, read at `row`; params: the
               floats of `TritonCall.params`; OPTIONS: the constexpr `TritonCall.options`.
               `values` is a tuple of this row's value columns, in the order of `values`.
    values:    names of the value columns it writes (a metric name makes it that metric's
               token mean).
    per_token: the value column holding the term's per-token value (before its weight).
    negate:    the per-token value is minus that column.
    teacher:   the row needs the teacher's statistics (the kernel's teacher pass).
    """

    name: str
    function: Any
    values: tuple[str, ...] = ()
    per_token: str = ""
    negate: bool = False
    teacher: bool = False


@dataclass(frozen=True)
class TritonCall:
    """What the Triton kernel runs for one term: its row and that row's specialisation
    (`options`: compile-time constants; `params`: run-time floats)."""

    row: TritonRow
    options: tuple = ()
    params: tuple[float, ...] = ()


@runtime_checkable
class LossUnit(Protocol):
    """A loss-kind unit module (the module docstring says what each member is). `term` is an
    instance of the unit's own `CONFIG`."""

    CONFIG: type[BaseModel]
    TRITON_ROW: TritonRow | None

    def needs(self, term: Any) -> frozenset[Stat]: ...

    def metric_names(self, term: Any) -> tuple[str, ...]: ...

    def row_loss(self, term: Any, stats: RowStats, inputs: RowInputs) -> RowLoss: ...

    def unfused_cost(self, term: Any) -> UnfusedCost: ...

    def describe(self, term: Any) -> tuple[str, str] | None: ...

    def triton(self, term: Any, *, has_old: bool, has_ref: bool) -> TritonCall: ...


def kind_of(unit: LossUnit) -> str:
    """The `kind` a unit's terms carry in recipes (its CONFIG's `kind` default)."""
    return unit.CONFIG.model_fields["kind"].default
