"""Per-row term math as Triton device functions: each adds its share of the logit-gradient
coefficients (dz = a p + b e_y + c p z) for one row, given the row's statistics.

`w` is the row's weight in the loss: the term's weight times its aggregation weight
(1 / valid tokens for token-mean), so dz is already the gradient of the final scalar loss.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cross_entropy(w, a, b):
    # d(lse - z_y)/dz = p - e_y
    return a + w, b - w


@triton.jit
def z_loss(w, lse, a):
    # d(lse^2)/dz = 2 lse p
    return a + 2.0 * w * lse


@triton.jit
def entropy_bonus(w, lse, entropy, a, c):
    # d(-H)/dz = p (z - lse + H)
    return a + w * (entropy - lse), c + w


@triton.jit
def of_logprob(w, grad, a, b):
    # d f(logp_y)/dz = f'(logp_y) (e_y - p)
    return a - w * grad, b + w * grad


@triton.jit
def grpo(
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
    """The grpo term (mtprun/losses/grpo.py): the policy gradient on r = exp(log_ratio)
    (PPO-clip with the dual clip, or CISPO), times the truncated IS weight, plus kl_coef * KL
    to the reference, and its derivative in logp.

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


@triton.jit
def soft_cross_entropy(w, a, d):
    # d(-sum q log p)/dz = p - q for a detached teacher q
    return a + w, d - w
