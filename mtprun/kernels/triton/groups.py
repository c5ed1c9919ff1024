"""Device-side per-row data of one row group: kernel row functions, weights and input slices.

A `RowGroup` (mtprun.kernels.row_groups) says which rows and terms; `KernelGroup` adds what the
Triton kernel reads: the terms' row functions with their options (`KernelTerms`), the student
rows, the [R, rows.NUM_WEIGHTS] weight matrix (each term's weight times its aggregation
weight), the per-token RL inputs gathered to the rows, and the buffers the kernel writes
(statistics and values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import triton.language as tl

from mtprun import losses
from mtprun.kernels.inputs import HeadInputs
from mtprun.kernels.row_groups import RowGroup, aggregation_weights
from mtprun.kernels.triton import rows as k
from mtprun.losses import LossAgg, grpo, sampler
from mtprun.losses.kind import TritonCall
from mtprun.losses.registry import TRITON_ROWS


@dataclass(frozen=True)
class KernelTerms:
    """What `head_rows_kernel` runs for one group (see its docstring): per slot of
    rows.WEIGHT_COLUMNS the row function, its constexpr options and run-time floats."""

    rows: tuple  # the row functions, None where no term of the group runs one
    options: tuple
    params: tuple
    teacher: bool  # a row function reads the teacher's statistics
    argmax: bool


@dataclass
class KernelGroup:
    """One row group ready for the kernel.

    The kernel's row functions, per-row inputs (weights, aggregation weights, gathered RL
    inputs) and output buffers are made on first use, inside the chunk loop: their host time and ~20
    small launches then queue behind the first logits GEMM instead of delaying it (at 3%
    active rows the whole step is a few milliseconds and the host prologue showed as GPU
    idle time).
    """

    group: RowGroup
    inputs: HeadInputs
    argmax: bool  # track each row's argmax (the MTP top-1 agreement needs it)
    student: torch.Tensor  # [R, H] student hidden rows (a view when no row is dropped)
    targets: torch.Tensor  # [R] int64 global target ids
    seq_log_ratio: torch.Tensor | None = None  # [R] GSPO's, set after the statistics pass
    _aggregations: dict[LossAgg, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        return self.targets.shape[0]

    @cached_property
    def calls(self) -> tuple[TritonCall, ...]:
        """What the kernel runs for each term of the group, in term order."""
        has_old = self.inputs.old_logprobs is not None
        has_ref = self.inputs.ref_logprobs is not None
        return tuple(losses.triton(t, has_old=has_old, has_ref=has_ref) for t in self.group.terms)

    @cached_property
    def kernel_terms(self) -> KernelTerms:
        return kernel_terms(self.calls, argmax=self.argmax)

    @property
    def topk(self) -> int:
        """k of an MTP top-k target (its sparse teacher is applied around the kernel), or 0."""
        return max((getattr(t, "topk", None) or 0 for t in self.group.terms), default=0)

    def aggregation(self, loss_agg: LossAgg) -> torch.Tensor:
        """[R] weights of `loss_agg` over the group's rows (inputs.aggregation_weights), made
        once per aggregation: each is a few launches queued between the first GEMM and the
        kernel, and the token means of the metrics reuse the token-mean one."""
        if loss_agg not in self._aggregations:
            inputs = self.inputs
            self._aggregations[loss_agg] = aggregation_weights(
                loss_agg,
                self.group,
                inputs.cu_seqlens,
                inputs.norm_length,
                inputs.tokens_per_sequence,
            )
        return self._aggregations[loss_agg]

    @cached_property
    def agg(self) -> dict[str, torch.Tensor]:
        """Metric name -> [R] aggregation weights of that term."""
        return {term.kind: self.aggregation(term.loss_agg) for term in self.group.terms}

    def column(self, name: str) -> torch.Tensor:
        """[R] view of the value column `name` of rows.VALUE_COLUMNS."""
        return self.values[:, k.VALUE_COLUMNS.index(name)]

    @cached_property
    def weights(self) -> torch.Tensor:
        """[R, rows.NUM_WEIGHTS] float32: each term's weight times its aggregation weight, in
        the column of its row function."""
        weights = self.targets.new_zeros(self.num_rows, k.NUM_WEIGHTS, dtype=torch.float32)
        for term, call in zip(self.group.terms, self.calls, strict=True):
            column = k.WEIGHT_COLUMNS.index(call.row.name)
            weights[:, column].add_(self.agg[term.kind], alpha=term.weight * self.group.head_scale)
        return weights

    @cached_property
    def per_token(self) -> torch.Tensor:
        """[R, rows.NUM_WEIGHTS] float32 per-token values by weight column (each row
        function's terms' value before their weight: -logp for CE, -entropy for the bonus,
        ...); call after the kernel has written `values`."""
        columns = [self.column(row.per_token) for row in TRITON_ROWS]
        signed = [-c if row.negate else c for c, row in zip(columns, TRITON_ROWS, strict=True)]
        return torch.stack(signed, dim=1)

    @cached_property
    def advantages(self) -> torch.Tensor | None:
        return self._gathered(self.inputs.advantages)

    @cached_property
    def old_logprobs(self) -> torch.Tensor | None:
        return self._gathered(self.inputs.old_logprobs)

    @cached_property
    def ref_logprobs(self) -> torch.Tensor | None:
        return self._gathered(self.inputs.ref_logprobs)

    @cached_property
    def sampler_logprobs(self) -> torch.Tensor | None:
        return self._gathered(self.inputs.sampler_logprobs)

    @cached_property
    def is_weights(self) -> torch.Tensor | None:
        """[R] truncated IS weights of the grpo term (losses.sampler), or None."""
        cap = next((t.tis_cap for t in self.group.terms if t.kind == "grpo"), None)
        if cap is None:
            return None
        return sampler.tis_weight(self.old_logprobs, self.sampler_logprobs, cap).contiguous()

    def token_inputs(self, start: int, stop: int, absent: torch.Tensor) -> tuple:
        """The per-token inputs of rows [start, stop) in the order the row functions read
        them (mtprun.losses.kind.TritonRow); `absent` stands in for a missing one."""
        inputs = (
            self.advantages,
            self.old_logprobs,
            self.ref_logprobs,
            self.seq_log_ratio,
            self.is_weights,
        )
        return tuple(absent if value is None else value[start:stop] for value in inputs)

    def set_sequence_ratio(self) -> None:
        """GSPO's per-sequence log-ratio from the statistics of every row (after the
        statistics pass and its exchange): a reduction over [R] vectors."""
        stats = self.stats
        column = k.STATS_COLUMNS.index
        lse = stats[:, column("max")] + stats[:, column("sumexp")].log()
        logp = stats[:, column("target_logit")] - lse
        old = logp if self.old_logprobs is None else self.old_logprobs
        num_sequences = self.inputs.cu_seqlens.shape[0] - 1
        group = self.group
        ratio = grpo.sequence_log_ratio(logp - old, group.seq_ids, group.valid, num_sequences)
        self.seq_log_ratio = ratio.contiguous()

    @cached_property
    def stats(self) -> torch.Tensor:
        """[R, 9] float32, written by the kernel."""
        return self.targets.new_zeros(self.num_rows, k.NUM_STATS, dtype=torch.float32)

    @cached_property
    def values(self) -> torch.Tensor:
        """[R, 9] float32, written by the kernel."""
        return self.targets.new_zeros(self.num_rows, k.NUM_VALUES, dtype=torch.float32)

    def _gathered(self, per_token: torch.Tensor | None) -> torch.Tensor | None:
        return None if per_token is None else per_token[self.group.rows].float().contiguous()


def build(
    group: RowGroup, inputs: HeadInputs, *, argmax: bool, student: torch.Tensor | None = None
) -> KernelGroup:
    """`argmax`: track each row's argmax (the MTP top-1 agreement needs it). `student`: the
    group's rows of its student hidden when already gathered."""
    rows = group.rows
    if student is None:
        full = rows.shape[0] == group.student.shape[0]
        student = group.student if full else group.student[rows]
    return KernelGroup(
        group=group,
        inputs=inputs,
        argmax=argmax,
        student=student,
        targets=group.targets.contiguous(),
    )


def kernel_terms(calls: tuple[TritonCall, ...], *, argmax: bool) -> KernelTerms:
    """The kernel's row slots for a group's terms (`calls`): each slot of TRITON_ROWS holds
    the function of the term that runs it (with its options and params), else None."""
    slots: list[TritonCall | None] = [None] * len(TRITON_ROWS)
    for call in calls:
        slot = TRITON_ROWS.index(call.row)
        if slots[slot] is None:  # two terms of one row add up in its weight column
            slots[slot] = call
    return KernelTerms(
        rows=tuple(None if c is None else c.row.function for c in slots),
        # Each option a tl.constexpr: Triton 3.6 passes a tuple of plain Python values on to
        # a device function's constexpr parameter without wrapping them (and fails).
        options=tuple(() if c is None else tuple(map(tl.constexpr, c.options)) for c in slots),
        params=tuple(() if c is None else c.params for c in slots),
        teacher=any(c.row.teacher for c in calls),
        argmax=argmax,
    )
