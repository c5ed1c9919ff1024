"""The per-row Triton kernel over a chunk of materialized logits: one program per row.

It runs in one of three modes:
  FUSED: pass 1 (online-softmax statistics), per-row term math, pass 2 (dz in place).
  STATS: pass 1 only; writes the shard-local statistics for the tensor-parallel exchange.
  GRAD:  loads statistics already combined over the TP group, then the math and pass 2.

Pass 2 overwrites the logits with the logit gradient dz = a p + b e_y + c p z + d q (q the
teacher's distribution), so the chunk buffer feeds the gradient GEMMs directly and no second
[rows x vocab] tensor exists. The term math lives in `coefficients.py`; this file holds the
vocab loops. Policy rows and MTP draft rows run the same kernel with different term flags.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mtprun.kernels.triton import coefficients as coef

FUSED = tl.constexpr(0)
STATS = tl.constexpr(1)
GRAD = tl.constexpr(2)

# Packed per-row statistics (float32 columns). Sums are relative to the row's own max, so
# shards combine as sum_r s_r exp(m_r - M). The argmax is a global vocab id; the target logit
# is 0 on shards that do not own the target. Teacher sums use the tempered teacher logits.
STATS_COLUMNS = (
    "max",
    "sumexp",
    "sum_ez",
    "target_logit",
    "argmax_value",
    "argmax",
    "teacher_max",
    "teacher_sumexp",
    "cross",
)
# Per-row values (float32 columns) for the loss and the metrics; a column stays 0 when its
# term is off. "soft_ce" is -sum q log p for the teacher q (distillation or an MTP head).
VALUE_COLUMNS = (
    "logp",
    "entropy",
    "lse",
    "z_loss",
    "grpo",
    "clipped",
    "kl",
    "ratio",
    "soft_ce",
)
# Per-row weight columns: each term's weight times its aggregation weight.
WEIGHT_COLUMNS = ("ce", "z_loss", "grpo", "entropy", "soft_ce", "plain")
NUM_STATS = len(STATS_COLUMNS)
NUM_VALUES = len(VALUE_COLUMNS)
NUM_WEIGHTS = len(WEIGHT_COLUMNS)
# The same numbers as the kernel reads them (row strides of the three buffers).
_STATS_STRIDE = tl.constexpr(NUM_STATS)
_VALUES_STRIDE = tl.constexpr(NUM_VALUES)
_WEIGHTS_STRIDE = tl.constexpr(NUM_WEIGHTS)


@triton.jit
def _online_tile(z, valid, start, m, s, sum_ez, best_val, best_idx, ARGMAX: tl.constexpr):
    """Fold one tile into running max, sum exp, sum exp*z and argmax (first occurrence)."""
    tile_max = tl.max(z, 0)
    if ARGMAX:
        best_idx = tl.where(tile_max > best_val, start + tl.argmax(z, 0), best_idx)
        best_val = tl.maximum(best_val, tile_max)
    m_new = tl.maximum(m, tile_max)
    alpha = tl.exp(m - m_new)
    e = tl.where(valid, tl.exp(z - m_new), 0.0)
    s = s * alpha + tl.sum(e, 0)
    sum_ez = sum_ez * alpha + tl.sum(e * tl.where(valid, z, 0.0), 0)
    return m_new, s, sum_ez, best_val, best_idx


@triton.jit
def _teacher_tile(zt, z, valid, t_m, t_s, cross):
    """Fold one teacher tile: running max, sum exp and sum exp(zt - t_m) * z (student z)."""
    t_m_new = tl.maximum(t_m, tl.max(zt, 0))
    alpha = tl.exp(t_m - t_m_new)
    q = tl.where(valid, tl.exp(zt - t_m_new), 0.0)
    t_s = t_s * alpha + tl.sum(q, 0)
    cross = cross * alpha + tl.sum(q * tl.where(valid, z, 0.0), 0)
    return t_m_new, t_s, cross


@triton.jit
def head_rows_kernel(
    logits_ptr,
    stride_row,
    teacher_ptr,
    stride_teacher,
    teacher_rows_ptr,
    inv_temperature,
    vocab_local,
    vocab_offset,
    targets_ptr,
    stats_ptr,
    values_ptr,
    weights_ptr,
    advantages_ptr,
    old_logprobs_ptr,
    ref_logprobs_ptr,
    seq_log_ratio_ptr,
    is_weights_ptr,
    clip_low,
    clip_high,
    clip_c,
    kl_coef,
    MODE: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_GRPO: tl.constexpr,
    HAS_OLD: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr,
    SEQ_RATIO: tl.constexpr,
    CISPO: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    HAS_IS_WEIGHT: tl.constexpr,
    HAS_ENTROPY_BONUS: tl.constexpr,
    HAS_TEACHER: tl.constexpr,
    HAS_PLAIN: tl.constexpr,
    ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row: statistics, then every term's value and coefficients, then dz in place.

    KL_ESTIMATOR: 0 = no reference log-probs, 1/2/3 = k1/k2/k3. SEQ_RATIO: the grpo ratio is
    exp(seq_log_ratio[row]) (GSPO; computed from every row's statistics, so GRAD mode only).
    CISPO / DUAL_CLIP: the grpo policy loss. HAS_IS_WEIGHT: the policy gradient is multiplied
    by is_weights[row] (truncated importance sampling). HAS_TEACHER: a soft-CE to
    the softmax of teacher_ptr[teacher_rows[row]] * inv_temperature (distillation, MTP soft).
    HAS_PLAIN: adds w p to dz and nothing to the values (the MTP top-k target, whose sparse
    -w q the caller subtracts). ARGMAX: track the row's argmax (MTP top-1 agreement).
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    stats = stats_ptr + row * _STATS_STRIDE
    offs = tl.arange(0, BLOCK_V)
    target_local = tl.load(targets_ptr + row) - vocab_offset
    owns_target = (target_local >= 0) & (target_local < vocab_local)
    teacher_row_ptr = teacher_ptr
    if HAS_TEACHER:
        teacher_row = tl.load(teacher_rows_ptr + row).to(tl.int64)
        teacher_row_ptr = teacher_ptr + teacher_row * stride_teacher

    if MODE == GRAD:
        m = tl.load(stats + 0)
        s = tl.load(stats + 1)
        sum_ez = tl.load(stats + 2)
        target_logit = tl.load(stats + 3)
        t_m = tl.load(stats + 6)
        t_s = tl.load(stats + 7)
        cross = tl.load(stats + 8)
    else:
        m = -float("inf")
        s = 0.0
        sum_ez = 0.0
        best_val = -float("inf")
        best_idx = 0
        t_m = -float("inf")
        t_s = 0.0
        cross = 0.0
        for start in range(0, vocab_local, BLOCK_V):
            cols = start + offs
            valid = cols < vocab_local
            z = tl.load(row_ptr + cols, mask=valid, other=-float("inf")).to(tl.float32)
            m, s, sum_ez, best_val, best_idx = _online_tile(
                z, valid, start, m, s, sum_ez, best_val, best_idx, ARGMAX
            )
            if HAS_TEACHER:
                zt = tl.load(teacher_row_ptr + cols, mask=valid, other=-float("inf"))
                zt = zt.to(tl.float32) * inv_temperature
                t_m, t_s, cross = _teacher_tile(zt, z, valid, t_m, t_s, cross)
        target_logit = tl.load(row_ptr + target_local, mask=owns_target, other=0.0)
        target_logit = target_logit.to(tl.float32)
        tl.store(stats + 5, (best_idx + vocab_offset).to(tl.float32))
        if MODE == STATS:
            tl.store(stats + 0, m)
            tl.store(stats + 1, s)
            tl.store(stats + 2, sum_ez)
            tl.store(stats + 3, target_logit)
            tl.store(stats + 4, best_val)
            tl.store(stats + 6, t_m)
            tl.store(stats + 7, t_s)
            tl.store(stats + 8, cross)
            return

    lse = m + tl.log(s)
    logp = target_logit - lse
    entropy = lse - sum_ez / s
    values = values_ptr + row * _VALUES_STRIDE
    weights = weights_ptr + row * _WEIGHTS_STRIDE
    tl.store(values + 0, logp)
    tl.store(values + 1, entropy)
    tl.store(values + 2, lse)
    a = 0.0
    b = 0.0
    c = 0.0
    d = 0.0
    if HAS_CE:
        a, b = coef.cross_entropy(tl.load(weights + 0), a, b)
    if HAS_Z:
        a = coef.z_loss(tl.load(weights + 1), lse, a)
        tl.store(values + 3, lse * lse)
    if HAS_GRPO:
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
        value, grad, clipped, kl, ratio = coef.grpo(
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
        a, b = coef.of_logprob(tl.load(weights + 2), grad, a, b)
        tl.store(values + 4, value)
        tl.store(values + 5, clipped)
        tl.store(values + 6, kl)
        tl.store(values + 7, ratio)
    if HAS_ENTROPY_BONUS:
        a, c = coef.entropy_bonus(tl.load(weights + 3), lse, entropy, a, c)
    teacher_lse = t_m
    if HAS_TEACHER:
        teacher_lse += tl.log(t_s)
        a, d = coef.soft_cross_entropy(tl.load(weights + 4), a, d)
        tl.store(values + 8, lse - cross / t_s)
    if HAS_PLAIN:
        a += tl.load(weights + 5)

    for start in range(0, vocab_local, BLOCK_V):
        cols = start + offs
        valid = cols < vocab_local
        z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)
        dz = (a + c * z) * p + tl.where(cols == target_local, b, 0.0)
        if HAS_TEACHER:
            zt = tl.load(teacher_row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
            dz += d * tl.exp(zt * inv_temperature - teacher_lse)
        tl.store(row_ptr + cols, dz.to(logits_ptr.dtype.element_ty), mask=valid)
