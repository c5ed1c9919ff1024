"""The per-row Triton kernel over a chunk of materialized logits: one program per row.

It runs in one of three modes:
  FUSED: pass 1 (online-softmax statistics), per-row term math, pass 2 (dz in place).
  STATS: pass 1 only; writes the shard-local statistics for the tensor-parallel exchange.
  GRAD:  loads statistics already combined over the TP group, then the math and pass 2.

Pass 2 overwrites the logits with the logit gradient dz = a p + b e_y + c p z + d q (q the
teacher's distribution), so the chunk buffer feeds the gradient GEMMs directly and no second
[rows x vocab] tensor exists. The term math lives in the loss-kind units (each one's Triton
row function, mtprun.losses.kind.TritonRow), passed in as constexpr arguments and inlined;
this file holds the vocab loops and the column layout derived from the units. Policy rows and
MTP draft rows run the same kernel with different row functions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mtprun.losses.registry import TRITON_ROWS

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
# Per-row values (float32 columns) for the loss and the metrics: the kernel's own, then each
# row function's (mtprun.losses.kind.TritonRow.values), in unit order; a column stays 0 when
# its term is off.
VALUE_COLUMNS = ("logp", "entropy", "lse", *(name for r in TRITON_ROWS for name in r.values))
# Per-row weight columns: each term's weight times its aggregation weight, one column per row
# function (column k is the weight of row function k).
WEIGHT_COLUMNS = tuple(r.name for r in TRITON_ROWS)
# Where each row function's values go, as the kernel reads them (a constexpr argument).
ROW_VALUE_COLUMNS = tuple(tuple(VALUE_COLUMNS.index(v) for v in r.values) for r in TRITON_ROWS)
NUM_STATS = len(STATS_COLUMNS)
NUM_VALUES = len(VALUE_COLUMNS)
NUM_WEIGHTS = len(WEIGHT_COLUMNS)
# The same numbers as the kernel reads them (row strides of the three buffers).
_STATS_STRIDE = tl.constexpr(NUM_STATS)
_VALUES_STRIDE = tl.constexpr(NUM_VALUES)
_WEIGHTS_STRIDE = tl.constexpr(NUM_WEIGHTS)


def _stat(name: str) -> tl.constexpr:
    return tl.constexpr(STATS_COLUMNS.index(name))


def _value(name: str) -> tl.constexpr:
    return tl.constexpr(VALUE_COLUMNS.index(name))


_MAX = _stat("max")
_SUMEXP = _stat("sumexp")
_SUM_EZ = _stat("sum_ez")
_TARGET_LOGIT = _stat("target_logit")
_ARGMAX_VALUE = _stat("argmax_value")
_ARGMAX = _stat("argmax")
_TEACHER_MAX = _stat("teacher_max")
_TEACHER_SUMEXP = _stat("teacher_sumexp")
_CROSS = _stat("cross")
_LOGP = _value("logp")
_ENTROPY = _value("entropy")
_LSE = _value("lse")


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
    token_inputs,
    row_params,
    MODE: tl.constexpr,
    ROWS: tl.constexpr,
    OPTIONS: tl.constexpr,
    ROW_VALUES: tl.constexpr,
    TEACHER: tl.constexpr,
    ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row: statistics, then every term's value and coefficients, then dz in place.

    ROWS: one slot per row function of rows.WEIGHT_COLUMNS, the function (a
    mtprun.losses.kind.TritonRow's) where a term of the group runs it, else None;
    OPTIONS[k] / row_params[k]: its constexpr options and run-time floats (not `params`:
    Triton 3.6's argument binder has a local of that name); ROW_VALUES[k]: the
    value columns it writes (ROW_VALUE_COLUMNS). token_inputs: the per-token input pointers
    the row functions read (TritonRow's docstring). TEACHER: a soft-CE to the softmax of
    teacher_ptr[teacher_rows[row]] * inv_temperature (distillation, MTP soft). ARGMAX: track
    the row's argmax (MTP top-1 agreement).
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    stats = stats_ptr + row * _STATS_STRIDE
    offs = tl.arange(0, BLOCK_V)
    target_local = tl.load(targets_ptr + row) - vocab_offset
    owns_target = (target_local >= 0) & (target_local < vocab_local)
    teacher_row_ptr = teacher_ptr
    if TEACHER:
        teacher_row = tl.load(teacher_rows_ptr + row).to(tl.int64)
        teacher_row_ptr = teacher_ptr + teacher_row * stride_teacher

    if MODE == GRAD:
        m = tl.load(stats + _MAX)
        s = tl.load(stats + _SUMEXP)
        sum_ez = tl.load(stats + _SUM_EZ)
        target_logit = tl.load(stats + _TARGET_LOGIT)
        t_m = tl.load(stats + _TEACHER_MAX)
        t_s = tl.load(stats + _TEACHER_SUMEXP)
        cross = tl.load(stats + _CROSS)
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
            if TEACHER:
                zt = tl.load(teacher_row_ptr + cols, mask=valid, other=-float("inf"))
                zt = zt.to(tl.float32) * inv_temperature
                t_m, t_s, cross = _teacher_tile(zt, z, valid, t_m, t_s, cross)
        target_logit = tl.load(row_ptr + target_local, mask=owns_target, other=0.0)
        target_logit = target_logit.to(tl.float32)
        tl.store(stats + _ARGMAX, (best_idx + vocab_offset).to(tl.float32))
        if MODE == STATS:
            tl.store(stats + _MAX, m)
            tl.store(stats + _SUMEXP, s)
            tl.store(stats + _SUM_EZ, sum_ez)
            tl.store(stats + _TARGET_LOGIT, target_logit)
            tl.store(stats + _ARGMAX_VALUE, best_val)
            tl.store(stats + _TEACHER_MAX, t_m)
            tl.store(stats + _TEACHER_SUMEXP, t_s)
            tl.store(stats + _CROSS, cross)
            return

    lse = m + tl.log(s)
    logp = target_logit - lse
    entropy = lse - sum_ez / s
    values = values_ptr + row * _VALUES_STRIDE
    weights = weights_ptr + row * _WEIGHTS_STRIDE
    tl.store(values + _LOGP, logp)
    tl.store(values + _ENTROPY, entropy)
    tl.store(values + _LSE, lse)
    a = 0.0
    b = 0.0
    c = 0.0
    d = 0.0
    row_stats = (lse, logp, entropy, cross, t_s)
    # Unrolled at compile time: each term's row function, inlined, with its weight (column k
    # of WEIGHT_COLUMNS is row function k's) and its value columns.
    for k in tl.static_range(len(ROWS)):
        if ROWS[k] is not None:
            a, b, c, d, row_values = ROWS[k](
                tl.load(weights + k),
                row,
                row_stats,
                token_inputs,
                row_params[k],
                a,
                b,
                c,
                d,
                OPTIONS[k],
            )
            for j in tl.static_range(len(ROW_VALUES[k])):
                tl.store(values + ROW_VALUES[k][j], row_values[j])
    teacher_lse = t_m
    if TEACHER:
        teacher_lse += tl.log(t_s)

    for start in range(0, vocab_local, BLOCK_V):
        cols = start + offs
        valid = cols < vocab_local
        z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)
        dz = (a + c * z) * p + tl.where(cols == target_local, b, 0.0)
        if TEACHER:
            zt = tl.load(teacher_row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
            dz += d * tl.exp(zt * inv_temperature - teacher_lse)
        tl.store(row_ptr + cols, dz.to(logits_ptr.dtype.element_ty), mask=valid)
