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

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from mtprun.losses import sampler
from mtprun.losses.kind import TermConfig, TritonCall, TritonRow, UnfusedCost
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.losses.triton_jit import jit, tl

if TYPE_CHECKING:
    import torch

KLEstimator = Literal["k1", "k2", "k3"]
PolicyLoss = Literal["clip", "cispo"]
RatioLevel = Literal["token", "sequence"]


class GRPOTerm(TermConfig):
    """Policy gradient on group-normalised advantages (PPO-clip, GSPO, CISPO, dual-clip, with a
    truncated importance-sampling correction), plus a KL to a reference.

    Formulas: mtprun/losses/grpo.py and docs/losses.md (policy-loss variants of the grpo term).
    """

    kind: Literal["grpo"] = Field("grpo", description="Term kind.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio lower bound is 1 - clip_low.")
    clip_high: float = Field(
        0.28,
        gt=0,
        description="Ratio upper bound is 1 + clip_high (cispo: the cap of its IS weight).",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: KLEstimator = Field(
        "k3",
        description="KL estimator (Schulman): k1 log-ratio, k2 squared, k3 unbiased low-variance.",
    )
    policy_loss: PolicyLoss = Field(
        "clip",
        description="clip: PPO's -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); cispo "
        "(MiniMax-M1): -sg(min(r, 1 + clip_high)) A logp, a clipped stop-gradient IS weight, "
        "so every token keeps its gradient.",
    )
    ratio: RatioLevel = Field(
        "token",
        description="token: r = exp(logp - old_logp) per token; sequence (GSPO): one r per "
        "sequence, exp of the mean of logp - old_logp over its trained tokens, clipped per "
        "sequence, its gradient reaching every token (GSPO uses clip ranges near 4e-4).",
    )
    clip_c: float | None = Field(
        None,
        gt=1,
        description="Dual-clip PPO: where A < 0 the surrogate is max(min(r A, clip(r) A), "
        "clip_c A), bounding what one token with a huge ratio can cost; null turns it off.",
    )
    tis_cap: float | None = Field(
        None,
        ge=1,
        description="Truncated importance sampling: the policy-gradient part of each token is "
        "weighted by min(pi_old / pi_sampler, tis_cap), pi_old the trainer's recomputed "
        "old policy, pi_sampler the rollout engine's (needs rollout.recompute_logprobs; "
        "at least 1, typically 2); null turns it off.",
    )

    @model_validator(mode="after")
    def _options_fit_the_policy_loss(self) -> GRPOTerm:
        if self.policy_loss == "cispo" and self.clip_c is not None:
            raise ValueError(
                "`clip_c` (dual-clip) bounds PPO's clipped surrogate and has no effect with "
                "policy_loss 'cispo': remove clip_c or use policy_loss: clip"
            )
        if self.policy_loss == "cispo" and "clip_low" in self.model_fields_set:
            raise ValueError(
                "policy_loss 'cispo' caps its IS weight at 1 + clip_high only: remove "
                "`clip_low` (it has no lower bound)"
            )
        return self


CONFIG = GRPOTerm


def needs(term: GRPOTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.TARGET_LOGIT})


# Also the value columns of the Triton row (the last three are token means).
_METRICS = ("grpo", "grpo/clip_frac", "grpo/kl", "grpo/ratio_mean")


def metric_names(term: GRPOTerm) -> tuple[str, ...]:
    return _METRICS


def row_loss(term: GRPOTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    logp = stats.logprob
    adv = inputs.advantages
    if term.ratio == "sequence":
        if inputs.seq_log_ratio is None:
            raise RuntimeError("ratio 'sequence' needs RowInputs.seq_log_ratio (the engine's)")
        ratio = inputs.seq_log_ratio.exp()
    else:
        old = logp if inputs.old_logprobs is None else inputs.old_logprobs
        ratio = (logp - old).exp()
    if term.policy_loss == "cispo":
        value, slope, clipped = _cispo(term, ratio, adv, logp)
    else:
        value, slope, clipped = _clip(term, ratio, adv)
    if term.tis_cap is not None:
        weight = sampler.tis_weight(inputs.old_logprobs, inputs.sampler_logprobs, term.tis_cap)
        value, slope = weight * value, weight * slope
    kl = logp.new_zeros(logp.shape)
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
    delta = log_ratio.where(valid, 0.0)
    sums = delta.new_zeros(num_sequences).index_add_(0, seq_ids, delta)
    counts = delta.new_zeros(num_sequences).index_add_(0, seq_ids, valid.to(delta.dtype))
    return (sums / counts.clamp(min=1))[seq_ids]


def _clip(
    term: GRPOTerm, ratio: torch.Tensor, adv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip (with the dual clip): value, d value / d logp and where a clip won."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - term.clip_low, 1 + term.clip_high) * adv
    surrogate = unclipped.minimum(clipped)
    # Where a clipped branch is the value, its ratio is a constant: no gradient.
    no_grad = clipped < unclipped
    if term.clip_c is not None:
        dual = (adv < 0) & (term.clip_c * adv > surrogate)
        surrogate = (term.clip_c * adv).where(dual, surrogate)
        no_grad = no_grad | dual
    return -surrogate, (-unclipped).masked_fill(no_grad, 0.0), no_grad


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
        return delta, delta.new_ones(delta.shape)
    if term.kl_estimator == "k2":
        return delta.square() / 2, delta
    inverse_ratio = (-delta).exp()
    return inverse_ratio + delta - 1, 1 - inverse_ratio


def unfused_cost(term: GRPOTerm) -> UnfusedCost:
    return UnfusedCost(buffers=1, reductions=3)


def describe(term: GRPOTerm) -> tuple[str, str] | None:
    """What `mtprun plan` shows of the policy-loss options."""
    if term.policy_loss == "cispo":
        loss = f"CISPO: -sg(min(r, {1 + term.clip_high:g})) A logp"
    else:
        loss = f"PPO-clip: r in [{1 - term.clip_low:g}, {1 + term.clip_high:g}]"
        if term.clip_c is not None:
            loss += f", dual-clip at {term.clip_c:g} A where A < 0"
    if term.ratio == "sequence":
        loss += "; GSPO sequence ratio (every row's statistics before any gradient)"
    if term.tis_cap is not None:
        loss += f"; truncated IS min(pi_old / pi_sampler, {term.tis_cap:g})"
    return "policy loss", loss


@jit
def _policy_gradient(
    logp,
    log_ratio,
    advantage,
    ref_logp,
    is_weight,
    clip_low,
    clip_high,
    clip_c,
    kl_coef,
    KL_ESTIMATOR: tl.constexpr,
    CISPO: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
):
    """`row_loss` for one row: the policy gradient on r = exp(log_ratio) (PPO-clip with the
    dual clip, or CISPO), times the truncated IS weight, plus kl_coef * KL to the reference,
    and its derivative in logp.

    Returns (value, d value / d logp, clipped (1.0 where the ratio's gradient is cut), kl,
    ratio).
    """
    ratio = tl.exp(log_ratio)
    if CISPO:
        weight = tl.minimum(ratio, 1.0 + clip_high)
        value = -weight * advantage * logp
        grad = -weight * advantage
        is_clipped = ratio > 1.0 + clip_high
    else:
        unclipped = ratio * advantage
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high) * advantage
        surrogate = tl.minimum(unclipped, clipped)
        is_clipped = clipped < unclipped
        if DUAL_CLIP:
            dual = (advantage < 0.0) & (clip_c * advantage > surrogate)
            surrogate = tl.where(dual, clip_c * advantage, surrogate)
            is_clipped = is_clipped | dual
        value = -surrogate
        grad = tl.where(is_clipped, 0.0, -unclipped)
    value = value * is_weight
    grad = grad * is_weight
    kl = 0.0
    if KL_ESTIMATOR == 1:
        kl = logp - ref_logp
        grad += kl_coef
    if KL_ESTIMATOR == 2:
        kl = 0.5 * (logp - ref_logp) * (logp - ref_logp)
        grad += kl_coef * (logp - ref_logp)
    if KL_ESTIMATOR == 3:
        log_ref_ratio = ref_logp - logp
        kl = tl.exp(log_ref_ratio) - log_ref_ratio - 1.0
        grad += kl_coef * (1.0 - tl.exp(log_ref_ratio))
    value += kl_coef * kl
    return value, grad, is_clipped.to(tl.float32), kl, ratio


@jit
def _triton_row(w, row, stats, token_inputs, params, a, b, c, d, OPTIONS: tl.constexpr):
    """OPTIONS (see `triton`): HAS_OLD: old log-probs given (else old = logp, on-policy);
    KL_ESTIMATOR: 0 = no reference log-probs, 1/2/3 = k1/k2/k3; SEQ_RATIO: the ratio is
    exp(seq_log_ratio[row]) (GSPO; from every row's statistics, so the kernel's GRAD mode
    only); CISPO / DUAL_CLIP: the policy loss; HAS_IS_WEIGHT: the policy gradient times
    is_weights[row] (truncated importance sampling)."""
    HAS_OLD, KL_ESTIMATOR, SEQ_RATIO, CISPO, DUAL_CLIP, HAS_IS_WEIGHT = OPTIONS
    clip_low, clip_high, clip_c, kl_coef = params
    advantages_ptr, old_logprobs_ptr, ref_logprobs_ptr, seq_log_ratio_ptr, is_weights_ptr = (
        token_inputs
    )
    _, logp, _, _, _ = stats
    advantage = tl.load(advantages_ptr + row)
    old = logp
    if HAS_OLD:
        old = tl.load(old_logprobs_ptr + row)
    ref = logp
    if KL_ESTIMATOR > 0:
        ref = tl.load(ref_logprobs_ptr + row)
    log_ratio = logp - old
    if SEQ_RATIO:
        log_ratio = tl.load(seq_log_ratio_ptr + row)
    is_weight = 1.0
    if HAS_IS_WEIGHT:
        is_weight = tl.load(is_weights_ptr + row)
    value, grad, clipped, kl, ratio = _policy_gradient(
        logp,
        log_ratio,
        advantage,
        ref,
        is_weight,
        clip_low,
        clip_high,
        clip_c,
        kl_coef,
        KL_ESTIMATOR,
        CISPO,
        DUAL_CLIP,
    )
    # d f(logp_y)/dz = f'(logp_y) (e_y - p)
    return a - w * grad, b + w * grad, c, d, (value, clipped, kl, ratio)


TRITON_ROW = TritonRow(
    name="grpo",
    function=_triton_row,
    values=_METRICS,
    per_token="grpo",
)
_KL_ESTIMATORS = {"k1": 1, "k2": 2, "k3": 3}


def triton(term: GRPOTerm, *, has_old: bool, has_ref: bool) -> TritonCall:
    options = (
        has_old,
        _KL_ESTIMATORS[term.kl_estimator] if has_ref else 0,
        term.ratio == "sequence",
        term.policy_loss == "cispo",
        term.clip_c is not None,
        term.tis_cap is not None,
    )
    params = (term.clip_low, term.clip_high, term.clip_c or 0.0, term.kl_coef)
    return TritonCall(TRITON_ROW, options=options, params=params)
