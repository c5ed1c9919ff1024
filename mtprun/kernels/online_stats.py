"""Online per-row statistics over vocab tiles, mergeable across tiles and tensor-parallel ranks.

A `PartialStats` summarises the logits of some vocab columns. Two partials over disjoint
columns merge exactly (the online-softmax rescaling), so the same `merge` folds tiles within a
rank and shards across ranks; `pack`/`unpack` turn one into a [R, K] tensor for the exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mtprun.kernels.row_groups import RowGroup
from mtprun.losses import RowStats, Stat, needs


@dataclass(frozen=True)
class StatsSpec:
    """Which optional statistics a row group computes besides the student's.

    teacher:       the group has teacher rows (its max and argmax are tracked).
    teacher_dense: the full teacher distribution q is used (soft targets, distillation).
    topk:          k of the teacher's top-k restriction, 0 when unused.
    """

    teacher: bool = False
    teacher_dense: bool = False
    topk: int = 0

    @classmethod
    def of(cls, group: RowGroup) -> StatsSpec:
        wanted = set().union(*(needs(t) for t in group.terms))
        return cls(
            teacher=group.teacher is not None and group.teacher_rows is not None,
            teacher_dense=bool(wanted & {Stat.TEACHER_LSE, Stat.TEACHER_CROSS}),
            topk=next((t.topk for t in group.terms if t.kind == "mtp" and t.topk), 0),
        )


@dataclass
class PartialStats:
    """Statistics of some vocab columns, float32 [R] (ids int64; top-k fields [R, k]).

    max, argmax:      max_v z_v over the columns and its global id.
    sumexp, centered: sum exp(z - max) and sum exp(z - max) (z - max).
    target:           z_y when y is among the columns, else 0 (so partials add up).
    t_max, t_argmax, t_sumexp: the same for the teacher's (tempered) logits t.
    t_cross:          sum exp(t - t_max) (z - max): the teacher-weighted student logit.
    topk_values, topk_ids, topk_student: the teacher's top-k logits, their ids, and the
                      student's logits at those ids.
    """

    max: torch.Tensor
    argmax: torch.Tensor
    sumexp: torch.Tensor
    centered: torch.Tensor
    target: torch.Tensor
    t_max: torch.Tensor | None = None
    t_argmax: torch.Tensor | None = None
    t_sumexp: torch.Tensor | None = None
    t_cross: torch.Tensor | None = None
    topk_values: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_student: torch.Tensor | None = None

    def pack(self) -> torch.Tensor:
        """[R, K] float64 (exact for float32 values and ids) in field order."""
        parts = [_as_columns(getattr(self, f.name)) for f in fields(self)]
        return torch.cat([p.double() for p in parts if p is not None], dim=1)

    @classmethod
    def empty(cls, spec: StatsSpec, device: torch.device) -> PartialStats:
        """Statistics of zero rows."""
        width = sum(_width(f.name, spec) for f in fields(cls))
        return cls.unpack(torch.zeros(0, width, dtype=torch.float64, device=device), spec)

    @classmethod
    def unpack(cls, packed: torch.Tensor, spec: StatsSpec) -> PartialStats:
        widths = {f.name: _width(f.name, spec) for f in fields(cls)}
        values: dict[str, torch.Tensor | None] = {}
        start = 0
        for name, width in widths.items():
            if width == 0:
                values[name] = None
                continue
            column = packed[:, start : start + width]
            start += width
            column = column.long() if name.endswith(("argmax", "ids")) else column.float()
            values[name] = column if name.startswith("topk") else column[:, 0]
        return cls(**values)


def tile_stats(
    z: torch.Tensor,
    targets: torch.Tensor,
    col_start: int,
    teacher: torch.Tensor | None,
    spec: StatsSpec,
) -> tuple[PartialStats, tuple[torch.Tensor, ...]]:
    """Statistics of one [C, T] tile of student logits z (and teacher logits) whose first
    column is global token id col_start. Overwrites z with z - max and returns the work
    buffers (z - max, exp(z - max), and exp(t - t_max) for a dense teacher) so that a caller
    holding the whole vocab can form the gradient without recomputing the logits."""
    row_max, argmax = z.max(dim=1)
    target = _gather_in_tile(z, targets, col_start)
    shifted = z.sub_(row_max[:, None])
    expz = shifted.exp()
    sumexp = expz.sum(dim=1)
    centered = torch.einsum("ij,ij->i", expz, shifted)
    stats = PartialStats(row_max, argmax + col_start, sumexp, centered, target)
    buffers: tuple[torch.Tensor, ...] = (shifted, expz)
    if spec.teacher:
        t_max, t_argmax = teacher.max(dim=1)
        stats.t_max, stats.t_argmax = t_max, t_argmax + col_start
        if spec.topk:
            _tile_topk(stats, teacher, shifted, row_max, col_start, spec.topk)
        if spec.teacher_dense:
            t_exp = teacher.sub_(t_max[:, None]).exp_()
            stats.t_sumexp = t_exp.sum(dim=1)
            stats.t_cross = torch.einsum("ij,ij->i", t_exp, shifted)
            buffers += (t_exp,)
    return stats, buffers


def merge(a: PartialStats, b: PartialStats) -> PartialStats:
    """Statistics of the union of two disjoint column sets (a's ids before b's)."""
    row_max = torch.maximum(a.max, b.max)
    scale_a, scale_b = torch.exp(a.max - row_max), torch.exp(b.max - row_max)
    out = PartialStats(
        max=row_max,
        argmax=torch.where(b.max > a.max, b.argmax, a.argmax),
        sumexp=scale_a * a.sumexp + scale_b * b.sumexp,
        centered=scale_a * (a.centered + (a.max - row_max) * a.sumexp)
        + scale_b * (b.centered + (b.max - row_max) * b.sumexp),
        target=a.target + b.target,
    )
    if a.t_max is not None:
        out.t_max = torch.maximum(a.t_max, b.t_max)
        out.t_argmax = torch.where(b.t_max > a.t_max, b.t_argmax, a.t_argmax)
    if a.t_sumexp is not None:
        t_scale_a, t_scale_b = torch.exp(a.t_max - out.t_max), torch.exp(b.t_max - out.t_max)
        out.t_sumexp = t_scale_a * a.t_sumexp + t_scale_b * b.t_sumexp
        out.t_cross = t_scale_a * (a.t_cross + (a.max - row_max) * a.t_sumexp) + t_scale_b * (
            b.t_cross + (b.max - row_max) * b.t_sumexp
        )
    if a.topk_values is not None:
        k = a.topk_values.shape[1]
        values = torch.cat([a.topk_values, b.topk_values], dim=1)
        out.topk_values, best = values.topk(k, dim=1)
        out.topk_ids = torch.cat([a.topk_ids, b.topk_ids], dim=1).gather(1, best)
        out.topk_student = torch.cat([a.topk_student, b.topk_student], dim=1).gather(1, best)
    return out


def finalize(stats: PartialStats) -> RowStats:
    """The per-row statistics the loss terms read, from the statistics of the whole vocab."""
    log_sumexp = stats.sumexp.log()
    out = RowStats(
        max=stats.max,
        lse=stats.max + log_sumexp,
        entropy=log_sumexp - stats.centered / stats.sumexp,
        target_logit=stats.target,
        argmax=stats.argmax,
        teacher_argmax=stats.t_argmax,
    )
    if stats.t_sumexp is not None:
        out.teacher_lse = stats.t_max + stats.t_sumexp.log()
        out.teacher_cross = stats.t_cross / stats.t_sumexp
    if stats.topk_values is not None:
        out.topk_ids = stats.topk_ids
        out.topk_probs = stats.topk_values.softmax(dim=1)
        out.topk_logits = stats.topk_student
    return out


def _tile_topk(
    stats: PartialStats,
    teacher: torch.Tensor,
    shifted: torch.Tensor,
    row_max: torch.Tensor,
    col_start: int,
    k: int,
) -> None:
    k_tile = min(k, teacher.shape[1])
    values, ids = teacher.topk(k_tile, dim=1)
    student = shifted.gather(1, ids) + row_max[:, None]
    if k_tile < k:  # a tile narrower than k: pad with -inf so the merge never picks padding
        pad = k - k_tile
        values = torch.cat([values, values.new_full((values.shape[0], pad), -torch.inf)], 1)
        ids = torch.cat([ids, ids.new_zeros((ids.shape[0], pad))], 1)
        student = torch.cat([student, student.new_zeros((student.shape[0], pad))], 1)
    stats.topk_values, stats.topk_ids, stats.topk_student = values, ids + col_start, student


def _gather_in_tile(z: torch.Tensor, targets: torch.Tensor, col_start: int) -> torch.Tensor:
    local = targets - col_start
    inside = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    return torch.where(inside, picked, 0.0)


def _width(name: str, spec: StatsSpec) -> int:
    if name.startswith("topk"):
        return spec.topk
    if name in ("t_max", "t_argmax"):
        return int(spec.teacher)
    if name in ("t_sumexp", "t_cross"):
        return int(spec.teacher_dense)
    return 1


def _as_columns(value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return None
    return value if value.dim() == 2 else value[:, None]
