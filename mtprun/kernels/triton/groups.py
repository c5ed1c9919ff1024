"""Device-side per-row data of one row group: kernel flags, weights and input slices.

A `RowGroup` (mtprun.kernels.inputs) says which rows and terms; `KernelGroup` adds what the
Triton kernel reads: the compile-time term flags, the student rows, the [R, 6] weight matrix
(each term's weight times its aggregation weight), the per-token RL inputs gathered to the
rows, and the buffers the kernel writes (statistics and values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from mtprun.kernels.inputs import HeadInputs, RowGroup, aggregation_weights
from mtprun.kernels.triton import rows as k
from mtprun.losses import grpo, sampler
from mtprun.spec.losses import LossAgg, LossTerm

_KL_ESTIMATORS = {"k1": 1, "k2": 2, "k3": 3}


@dataclass(frozen=True)
class TermFlags:
    """Compile-time switches of `head_rows_kernel` for one group (see its docstring)."""

    ce: bool = False
    z_loss: bool = False
    grpo: bool = False
    has_old: bool = False
    kl_estimator: int = 0
    seq_ratio: bool = False
    cispo: bool = False
    dual_clip: bool = False
    tis_cap: float | None = None
    entropy_bonus: bool = False
    teacher: bool = False
    plain: bool = False
    topk: int = 0
    argmax: bool = False
    clip_low: float = 0.0
    clip_high: float = 0.0
    clip_c: float = 0.0
    kl_coef: float = 0.0
    inv_temperature: float = 1.0


@dataclass
class KernelGroup:
    """One row group ready for the kernel.

    The kernel flags, per-row inputs (weights, aggregation weights, gathered RL inputs) and
    output buffers are made on first use, inside the chunk loop: their host time and ~20
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
    def flags(self) -> TermFlags:
        return term_flags(
            self.group,
            has_old=self.inputs.old_logprobs is not None,
            has_ref=self.inputs.ref_logprobs is not None,
            argmax=self.argmax,
        )

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
        """[R, 6] float32: each term's weight times its aggregation weight, by column."""
        weights = self.targets.new_zeros(self.num_rows, k.NUM_WEIGHTS, dtype=torch.float32)
        for term in self.group.terms:
            column = k.WEIGHT_COLUMNS.index(weight_column(term))
            weights[:, column].add_(self.agg[term.kind], alpha=term.weight * self.group.head_scale)
        return weights

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
        cap = self.flags.tis_cap
        if cap is None:
            return None
        return sampler.tis_weight(self.old_logprobs, self.sampler_logprobs, cap).contiguous()

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

    @cached_property
    def per_token(self) -> torch.Tensor:
        """[R, 6] float32 per-token values in the order of rows.WEIGHT_COLUMNS (each term's
        value before its weight: -logp for CE, -entropy for the bonus, ...); call after the
        kernel has written `values`."""
        soft = self.column("soft_ce")
        terms = (-self.column("logp"), self.column("z_loss"), self.column("grpo"))
        return torch.stack((*terms, -self.column("entropy"), soft, soft), dim=1)

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


def weight_column(term: LossTerm) -> str:
    """The column of rows.WEIGHT_COLUMNS (and of the per-token values) a term adds to."""
    if term.kind == "mtp":
        return {"soft": "soft_ce", "topk": "plain", "hard": "ce"}[term.target]
    return {"distill": "soft_ce"}.get(term.kind, term.kind)


def term_flags(group: RowGroup, *, has_old: bool, has_ref: bool, argmax: bool) -> TermFlags:
    """The kernel switches of a group's terms."""
    flags: dict[str, object] = {
        "argmax": argmax,
        "inv_temperature": 1.0 / group.teacher_temperature,
    }
    for term in group.terms:
        if term.kind in ("ce", "z_loss"):
            flags[term.kind] = True
        elif term.kind == "entropy":
            flags["entropy_bonus"] = term.coef > 0
        elif term.kind == "grpo":
            flags.update(
                grpo=True,
                has_old=has_old,
                kl_estimator=_KL_ESTIMATORS[term.kl_estimator] if has_ref else 0,
                seq_ratio=term.ratio == "sequence",
                cispo=term.policy_loss == "cispo",
                dual_clip=term.clip_c is not None,
                tis_cap=term.tis_cap,
                clip_low=term.clip_low,
                clip_high=term.clip_high,
                clip_c=term.clip_c or 0.0,
                kl_coef=term.kl_coef,
            )
        elif term.kind == "distill":
            flags["teacher"] = True
        elif term.kind == "mtp":
            flags.update(
                {
                    "soft": {"teacher": True},
                    "topk": {"plain": True, "topk": term.topk or 0},
                    "hard": {"ce": True},
                }[term.target]
            )
        else:
            raise ValueError(f"the Triton head loss has no kernel for term kind {term.kind!r}")
    return TermFlags(**flags)
