"""GRPO-family policy gradients with a KL to a reference: a function f of logp_y = z_y - lse
only (the ratio and the IS weights are constants of the row), so d f / dz = f'(logp_y) (e_y - p).

Per token, with A the advantage, old the old log-prob (old = logp, ratio 1 with its gradient,
when old_logprobs is None: on-policy) and sg() a stop-gradient:

  ratio: token     r = exp(logp - old)
         sequence  r = exp(sg(m_s) + logp - sg(logp)) with m_s the mean of logp - old over the
                   trained tokens of the row's sequence s (GSPO-token, Zheng et al. 2025):
                   its value is the sequence ratio s_i = (pi / pi_old)(y_i)^(1 / |y_i|), one
                   per sequence, clipped per sequence, and d r / d logp_t = s_i at every token
                   (under seq-mean-token-mean this is GSPO's gradient exactly).
  policy_loss: clip   pg = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
                      with clip_c (dual-clip PPO, Ye et al. 2020), where A < 0:
                      pg = -max(min(r A, clip(r, ...) A), clip_c A)
               cispo  pg = -sg(min(r, 1 + clip_high)) A logp (MiniMax-M1)
  tis_cap C:   pg = sg(w) pg with w = min(pi_old / pi_sampler, C) (losses/sampler.py)
  value = pg + kl_coef KL, the KL to ref_logprobs estimated by k1 = logp - ref,
  k2 = (logp - ref)^2 / 2 or k3 = exp(ref - logp) - (ref - logp) - 1.

Metrics: clip_frac (tokens whose pg has no gradient through the ratio: a clip or the dual
clip won; cispo: the IS weight was capped), kl, ratio_mean (r, the sequence ratio under GSPO).
"""

import torch

from mtprun.losses import sampler
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
    if term.ratio == "sequence":
        if inputs.seq_log_ratio is None:
            raise RuntimeError("ratio 'sequence' needs RowInputs.seq_log_ratio (the engine's)")
        ratio = torch.exp(inputs.seq_log_ratio)
    else:
        old = logp if inputs.old_logprobs is None else inputs.old_logprobs
        ratio = torch.exp(logp - old)
    if term.policy_loss == "cispo":
        value, slope, clipped = _cispo(term, ratio, adv, logp)
    else:
        value, slope, clipped = _clip(term, ratio, adv)
    if term.tis_cap is not None:
        weight = sampler.tis_weight(inputs.old_logprobs, inputs.sampler_logprobs, term.tis_cap)
        value, slope = weight * value, weight * slope
    kl = torch.zeros_like(logp)
    if inputs.ref_logprobs is not None:
        kl, kl_slope = _kl(term, logp - inputs.ref_logprobs)
        value = value + term.kl_coef * kl
        slope = slope + term.kl_coef * kl_slope
    metrics = {"clip_frac": clipped.float(), "kl": kl, "ratio_mean": ratio}
    return RowLoss(value=value, grad=GradCoeffs(a=-slope, b=slope), metrics=metrics)


def sequence_log_ratio(
    log_ratio: torch.Tensor, seq_ids: torch.Tensor, valid: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """[R] GSPO's m_s at each row: the mean of log_ratio over the valid rows of its sequence.
    Needs every row of each sequence at once (a reduction over [R] vectors, not the vocab)."""
    delta = torch.where(valid, log_ratio, 0.0)
    sums = delta.new_zeros(num_sequences).index_add_(0, seq_ids, delta)
    counts = delta.new_zeros(num_sequences).index_add_(0, seq_ids, valid.to(delta.dtype))
    return (sums / counts.clamp(min=1))[seq_ids]


def _clip(
    term: GRPOTerm, ratio: torch.Tensor, adv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip (with the dual clip): value, d value / d logp and where a clip won."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - term.clip_low, 1 + term.clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    # Where a clipped branch is the value, its ratio is a constant: no gradient.
    no_grad = clipped < unclipped
    if term.clip_c is not None:
        dual = (adv < 0) & (term.clip_c * adv > surrogate)
        surrogate = torch.where(dual, term.clip_c * adv, surrogate)
        no_grad = no_grad | dual
    return -surrogate, torch.where(no_grad, 0.0, -unclipped), no_grad


def _cispo(
    term: GRPOTerm, ratio: torch.Tensor, adv: torch.Tensor, logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: value -sg(min(r, 1 + clip_high)) A logp, its slope and where the cap bit."""
    cap = 1 + term.clip_high
    weight = ratio.clamp(max=cap)
    return -weight * adv * logp, -weight * adv, ratio > cap


def _kl(term: GRPOTerm, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL estimate and its derivative w.r.t. logp, for delta = logp - ref."""
    if term.kl_estimator == "k1":
        return delta, torch.ones_like(delta)
    if term.kl_estimator == "k2":
        return delta.square() / 2, delta
    inverse_ratio = torch.exp(-delta)
    return inverse_ratio + delta - 1, 1 - inverse_ratio
