"""The sampler/trainer mismatch: old log-probs recomputed by the trainer (pi_old,
`rollout.recompute_logprobs`) against the log-probs the rollout engine sampled with
(pi_sampler). Both are inputs: nothing here needs the vocab pass.

Truncated importance sampling (a grpo term's tis_cap = C, Yao et al. 2025): each token's
policy-gradient term is multiplied by the detached weight w = min(pi_old / pi_sampler, C).

Per-token metrics (token means over the trained tokens): logprob_mismatch = |log pi_old -
log pi_sampler|; with tis_cap also is_weight_mean = w and is_clip_frac = [pi_old / pi_sampler > C].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the spec layer imports the units: no torch at import
    import torch


def metric_names(tis_cap: float | None) -> tuple[str, ...]:
    return ("logprob_mismatch",) if tis_cap is None else ("logprob_mismatch", *_TIS_METRICS)


def tis_weight(old: torch.Tensor, sampler: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(exp(old - sampler), cap); a constant of the loss (no gradient)."""
    return (old - sampler).exp().clamp(max=cap)


def row_metrics(
    old: torch.Tensor, sampler: torch.Tensor, tis_cap: float | None
) -> dict[str, torch.Tensor]:
    """Per-token values of `metric_names(tis_cap)`, to be averaged over the trained tokens."""
    delta = old - sampler
    metrics = {"logprob_mismatch": delta.abs()}
    if tis_cap is not None:
        metrics["is_weight_mean"] = tis_weight(old, sampler, tis_cap)
        metrics["is_clip_frac"] = (delta.exp() > tis_cap).float()
    return metrics


_TIS_METRICS = ("is_weight_mean", "is_clip_frac")
