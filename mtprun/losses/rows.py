"""Per-row data the loss terms read and write (after the vocab pass and the TP exchange).

Every term sees the final statistics of its rows and returns its per-token value, per-token
metrics and its gradient w.r.t. the row's logits z in the fused form

    d value / dz = a * p + b * e_y + c * p * (z - max) + d * q

with p = softmax(z), e_y the one-hot target, q the teacher distribution (full or top-k) and
per-row scalars a, b, c, d (None where a term does not use one). Centring z on the row max
keeps the entropy gradient accurate in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the spec layer imports the units: no torch at import
    import torch


@dataclass
class RowStats:
    """Final per-row statistics, float32 [R] unless noted.

    max:           max_v z_v.
    lse:           logsumexp_v z_v.
    entropy:       H = lse - sum_v p_v z_v.
    target_logit:  z_y.
    argmax:        int64 argmax_v z_v (first on ties) or None.
    teacher_lse:   logsumexp of the teacher's (tempered) logits, or None.
    teacher_cross: sum_v q_v (z_v - max), q = the teacher distribution, or None.
    teacher_argmax: int64 argmax of the teacher row, or None.
    topk_ids:      [R, k] int64 the teacher's top-k token ids, or None.
    topk_probs:    [R, k] the teacher's distribution restricted to its top-k, or None.
    topk_logits:   [R, k] the student's logits z at topk_ids, or None.
    """

    max: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    target_logit: torch.Tensor
    argmax: torch.Tensor | None = None
    teacher_lse: torch.Tensor | None = None
    teacher_cross: torch.Tensor | None = None
    teacher_argmax: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_probs: torch.Tensor | None = None
    topk_logits: torch.Tensor | None = None

    def select(self, rows: slice) -> RowStats:
        """The statistics of a slice of rows."""
        return RowStats(**{f.name: _take(getattr(self, f.name), rows) for f in fields(self)})

    @property
    def logprob(self) -> torch.Tensor:
        return self.target_logit - self.lse


@dataclass
class RowInputs:
    """Per-token inputs of the rows, float32 [R] or None.

    sampler_logprobs: the rollout engine's log-probs when old_logprobs are the trainer's.
    seq_log_ratio:    GSPO's mean of logp - old over the trained tokens of each row's
                      sequence, filled in by the engine once every row's logp is known.
    """

    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    seq_log_ratio: torch.Tensor | None = None

    def select(self, rows: slice) -> RowInputs:
        return RowInputs(**{f.name: _take(getattr(self, f.name), rows) for f in fields(self)})


@dataclass
class GradCoeffs:
    """Per-row coefficients of d value / dz (see the module docstring); None means zero."""

    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    c: torch.Tensor | None = None
    d: torch.Tensor | None = None

    def add_(self, other: GradCoeffs, scale: torch.Tensor) -> GradCoeffs:
        """self += scale * other, coefficient by coefficient."""
        for name in ("a", "b", "c", "d"):
            theirs = getattr(other, name)
            if theirs is None:
                continue
            mine = getattr(self, name)
            setattr(self, name, scale * theirs if mine is None else mine + scale * theirs)
        return self

    def select(self, rows: slice) -> GradCoeffs:
        return GradCoeffs(**{f.name: _take(getattr(self, f.name), rows) for f in fields(self)})


@dataclass
class RowLoss:
    """A term's per-token value [R], gradient coefficients and per-token metrics [R]
    (metric keys are suffixes: "clip_frac" is reported as "grpo/clip_frac")."""

    value: torch.Tensor
    grad: GradCoeffs
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _take(value: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if value is None else value[rows]
