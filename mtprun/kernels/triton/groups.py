"""Device-side per-row data of one row group: kernel flags, weights and input slices.

A `RowGroup` (mtprun.kernels.inputs) says which rows and terms; `KernelGroup` adds what the
Triton kernel reads: the compile-time term flags, the [R, 6] weight matrix (each term's
weight times its aggregation weight), the per-token RL inputs gathered to the rows, and the
buffers the kernel writes (statistics and values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtprun.kernels.inputs import HeadInputs, RowGroup, aggregation_weights
from mtprun.kernels.triton import rows as k
from mtprun.spec.losses import LossTerm

_KL_ESTIMATORS = {"k1": 1, "k2": 2, "k3": 3}


@dataclass(frozen=True)
class TermFlags:
    """Compile-time switches of `head_rows_kernel` for one group (see its docstring)."""

    ce: bool = False
    z_loss: bool = False
    grpo: bool = False
    has_old: bool = False
    kl_estimator: int = 0
    entropy_bonus: bool = False
    teacher: bool = False
    plain: bool = False
    topk: int = 0
    argmax: bool = False
    clip_low: float = 0.0
    clip_high: float = 0.0
    kl_coef: float = 0.0
    inv_temperature: float = 1.0


@dataclass
class KernelGroup:
    """One row group ready for the kernel. `agg` maps a metric name to its [R] weights."""

    group: RowGroup
    flags: TermFlags
    student: torch.Tensor  # [R, H] student hidden rows (a view when no row is dropped)
    targets: torch.Tensor  # [R] int64 global target ids
    weights: torch.Tensor  # [R, 6] float32
    agg: dict[str, torch.Tensor]
    advantages: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    stats: torch.Tensor  # [R, 9] float32, written by the kernel
    values: torch.Tensor  # [R, 9] float32, written by the kernel

    @property
    def num_rows(self) -> int:
        return self.targets.shape[0]


def build(group: RowGroup, inputs: HeadInputs, *, argmax: bool) -> KernelGroup:
    """`argmax`: track each row's argmax (the MTP top-1 agreement needs it)."""
    rows = group.rows
    n_rows = rows.shape[0]
    device = inputs.hidden.device
    weights = torch.zeros(n_rows, k.NUM_WEIGHTS, dtype=torch.float32, device=device)
    agg: dict[str, torch.Tensor] = {}
    for term in group.terms:
        agg[term.kind] = aggregation_weights(term.loss_agg, group, inputs.cu_seqlens)
        column = k.WEIGHT_COLUMNS.index(weight_column(term))
        weights[:, column] += agg[term.kind] * (term.weight * group.head_scale)
    per_token = {
        name: None if value is None else value[rows].float().contiguous()
        for name, value in (
            ("advantages", inputs.advantages),
            ("old_logprobs", inputs.old_logprobs),
            ("ref_logprobs", inputs.ref_logprobs),
        )
    }
    flags = term_flags(
        group,
        has_old=per_token["old_logprobs"] is not None,
        has_ref=per_token["ref_logprobs"] is not None,
        argmax=argmax,
    )
    student = group.student if n_rows == group.student.shape[0] else group.student[rows]
    return KernelGroup(
        group=group,
        flags=flags,
        student=student,
        targets=group.targets.contiguous(),
        weights=weights,
        agg=agg,
        stats=torch.zeros(n_rows, k.NUM_STATS, dtype=torch.float32, device=device),
        values=torch.zeros(n_rows, k.NUM_VALUES, dtype=torch.float32, device=device),
        **per_token,
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
                clip_low=term.clip_low,
                clip_high=term.clip_high,
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
