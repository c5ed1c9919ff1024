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
    flags: dict[str, object] = {"argmax": argmax}
    for term in group.terms:
        term_agg = aggregation_weights(term.loss_agg, group, inputs.cu_seqlens)
        scaled = term_agg * (term.weight * group.head_scale)
        column = _weight_column(term)
        weights[:, k.WEIGHT_COLUMNS.index(column)] += scaled
        agg[term.kind] = term_agg
        flags.update(_flags(term, inputs))
    per_token = {
        name: None if value is None else value[rows].float().contiguous()
        for name, value in (
            ("advantages", inputs.advantages),
            ("old_logprobs", inputs.old_logprobs),
            ("ref_logprobs", inputs.ref_logprobs),
        )
    }
    if flags.get("grpo"):
        flags["has_old"] = per_token["old_logprobs"] is not None
        flags["kl_estimator"] = (
            _KL_ESTIMATORS[flags.pop("kl_name")] if per_token["ref_logprobs"] is not None else 0
        )
    flags.pop("kl_name", None)
    if group.teacher_temperature != 1.0:
        flags["inv_temperature"] = 1.0 / group.teacher_temperature
    student = group.student
    if n_rows != student.shape[0]:
        student = student[rows]
    return KernelGroup(
        group=group,
        flags=TermFlags(**flags),
        student=student,
        targets=group.targets.contiguous(),
        weights=weights,
        agg=agg,
        stats=torch.zeros(n_rows, k.NUM_STATS, dtype=torch.float32, device=device),
        values=torch.zeros(n_rows, k.NUM_VALUES, dtype=torch.float32, device=device),
        **per_token,
    )


def _weight_column(term) -> str:
    if term.kind == "mtp":
        return {"soft": "soft_ce", "topk": "plain", "hard": "ce"}[term.target]
    return {"distill": "soft_ce"}.get(term.kind, term.kind)


def _flags(term, inputs: HeadInputs) -> dict[str, object]:
    if term.kind == "ce":
        return {"ce": True}
    if term.kind == "z_loss":
        return {"z_loss": True}
    if term.kind == "entropy":
        return {"entropy_bonus": term.coef > 0}
    if term.kind == "grpo":
        return {
            "grpo": True,
            "clip_low": term.clip_low,
            "clip_high": term.clip_high,
            "kl_coef": term.kl_coef,
            "kl_name": term.kl_estimator,
        }
    if term.kind == "distill":
        return {"teacher": True}
    if term.kind == "mtp":
        return {
            "soft": {"teacher": True},
            "topk": {"plain": True, "topk": term.topk or 0},
            "hard": {"ce": True},
        }[term.target]
    raise ValueError(f"the Triton head loss has no kernel for term kind {term.kind!r}")
