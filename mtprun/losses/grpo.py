"""GRPO / PPO-clip with a KL to a reference: a function f of logp_y = z_y - lse only, so
d f / dz = f'(logp_y) (e_y - p).

Per token: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef KL with
r = exp(logp - old_logprobs) (r = 1 with its gradient when old_logprobs is None: on-policy)
and KL to ref_logprobs estimated by k1 = logp - ref, k2 = (logp - ref)^2 / 2 or
k3 = exp(ref - logp) - (ref - logp) - 1.
"""

import torch

from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.spec.losses import GRPOTerm


def needs(term: GRPOTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.TARGET_LOGIT})


def metric_names(term: GRPOTerm) -> tuple[str, ...]:
    return ("grpo", "grpo/clip_frac", "grpo/kl", "grpo/ratio_mean")


def row_loss(term: GRPOTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    logp = stats.logprob
    adv = inputs.advantages
    old = logp if inputs.old_logprobs is None else inputs.old_logprobs
    ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1 - term.clip_low, 1 + term.clip_high)
    unclipped_wins = ratio * adv <= clipped * adv
    value = -torch.minimum(ratio * adv, clipped * adv)
    # Where the clipped branch is the min, its ratio is a constant: no gradient.
    slope = torch.where(unclipped_wins, -adv * ratio, 0.0)
    kl = torch.zeros_like(logp)
    if inputs.ref_logprobs is not None:
        kl, kl_slope = _kl(term, logp - inputs.ref_logprobs)
        value = value + term.kl_coef * kl
        slope = slope + term.kl_coef * kl_slope
    metrics = {"clip_frac": (~unclipped_wins).float(), "kl": kl, "ratio_mean": ratio}
    return RowLoss(value=value, grad=GradCoeffs(a=-slope, b=slope), metrics=metrics)


def _kl(term: GRPOTerm, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL estimate and its derivative w.r.t. logp, for delta = logp - ref."""
    if term.kl_estimator == "k1":
        return delta, torch.ones_like(delta)
    if term.kl_estimator == "k2":
        return delta.square() / 2, delta
    inverse_ratio = torch.exp(-delta)
    return inverse_ratio + delta - 1, 1 - inverse_ratio
