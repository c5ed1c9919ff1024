"""`adamw_step_`: one AdamW step of one parameter tensor in one Triton launch, its two moments
stored in float32 or in bfloat16 (`trainer.optimizer_state`), on CUDA, optionally writing the
updated parameter's bf16 model copy in the same pass.

For a parameter p (float32: the distributed optimizer's master copy), its gradient g, the
moments m and v, and step t (1-based):

    p <- p (1 - lr wd)
    m <- m + (1 - beta1) (g - m)
    v <- beta2 v + (1 - beta2) g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

which is torch's AdamW. The arithmetic runs in float32 on the loaded values, and the update
uses the new moments before they are stored. bfloat16 moments are rounded stochastically: a
value between two bf16 neighbours goes up with probability equal to its distance from the
lower one, so the stored moments are unbiased. Rounding to nearest would not be: with beta2 =
0.999, v's per-step change of 0.1% is below half a bf16 ulp (0.2%), so v would stop decaying
and only grow on gradient spikes, an AMSGrad-like drift that shrinks the updates.

The rounding's random bits are a hash of the step's seed and the float32 value being rounded,
not of its position, so equal tensors stay equal wherever they sit: parameters that are
replicated over tensor-parallel ranks, or a tied embedding and its copy on the last pipeline
stage, take the same update on every rank whatever their offset in the optimizer's shards.
The hash is an integer mixer of two multiplies (`_hash32`), not a Philox draw: Philox's ten
rounds for each of the two moments made the kernel compute-bound (2.7 TB/s on an H200, where
the float32-moment kernel, with more bytes a parameter, streams 4.1 TB/s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _round_to_bf16(x, seed):
    """float32 -> bfloat16, up or down with the probabilities that keep the mean (the 16
    dropped bits against 16 random ones, a hash of `seed` and x's own bits)."""
    bits = x.to(tl.uint32, bitcast=True)
    noise = _hash32(bits ^ seed.to(tl.uint32)) & 0xFFFF
    return _bf16_of_high_bits(bits + noise)


@triton.jit
def _hash32(x):
    """A 32-bit integer hash whose every output bit depends on every input bit (C. Wellons'
    "lowbias32" mixer: xor-shifts and two odd multiplies, modulo 2^32)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _round_to_nearest_bf16(x):
    """float32 -> bfloat16 rounded to nearest, ties to even, as torch's casts round; in bits,
    because the Triton interpreter's cast truncates (how CPU tests run this kernel)."""
    bits = x.to(tl.uint32, bitcast=True)
    return _bf16_of_high_bits(bits + 0x7FFF + ((bits >> 16) & 1))


@triton.jit
def _bf16_of_high_bits(bits):
    """The bfloat16 whose bits are the high 16 of the float32 bits `bits` (exact: the low 16
    cleared first, so no cast rounds)."""
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit(do_not_specialize=["seed_m", "seed_v"])
def adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    copy_ptr,
    numel,
    grad_scale,
    decay,
    beta1,
    beta2,
    eps,
    step_size,
    bias_correction2_sqrt,
    seed_m,
    seed_v,
    STOCHASTIC: tl.constexpr,
    COPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Elements [i BLOCK, (i+1) BLOCK) of one parameter, updated in place."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    p = tl.load(p_ptr + offsets, mask=inside).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=inside).to(tl.float32) * grad_scale
    m = tl.load(m_ptr + offsets, mask=inside).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=inside).to(tl.float32)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=inside)
    if COPY:
        if copy_ptr.dtype.element_ty == tl.bfloat16:
            tl.store(copy_ptr + offsets, _round_to_nearest_bf16(p), mask=inside)
        else:
            tl.store(copy_ptr + offsets, p.to(copy_ptr.dtype.element_ty), mask=inside)
    if STOCHASTIC:
        tl.store(m_ptr + offsets, _round_to_bf16(m, seed_m), mask=inside)
        tl.store(v_ptr + offsets, _round_to_bf16(v, seed_v), mask=inside)
    else:
        tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=inside)
        tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=inside)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    seed: int,
    grad_scale: float = 1.0,
    model_copy: torch.Tensor | None = None,
) -> None:
    """One AdamW step (module docstring) of `param` in place, `step` the 1-based count this
    update makes, the gradient taken as `grad_scale` g (gradient clipping's coefficient,
    applied here rather than by a pass over the gradients before the step). `exp_avg` and
    `exp_avg_sq` (one dtype: float32, or bfloat16 rounded stochastically with random bits from
    `seed`) are updated in place; `grad` is read in any float dtype. `model_copy` (any float
    dtype, e.g. the bf16 weights the model computes with) receives the updated parameter,
    rounded to nearest: one read of the parameter less than a copy after the step. Every tensor
    contiguous, of one shape."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if model_copy is not None:
        tensors += (model_copy,)
    if any(t.shape != param.shape or not t.is_contiguous() for t in tensors):
        raise ValueError("adamw_step_ takes contiguous tensors of one shape")
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"the moments must both be float32 or both bfloat16, not {exp_avg.dtype} and "
            f"{exp_avg_sq.dtype}"
        )
    numel = param.numel()
    if numel == 0:
        return
    # Two 31-bit seeds, one a moment (each is xor-ed into the 32 bits the hash mixes).
    seed_m, seed_v = ((seed * 2 + k) & 0x7FFFFFFF for k in (0, 1))
    adamw_kernel[(triton.cdiv(numel, _BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param if model_copy is None else model_copy,
        numel,
        grad_scale,
        1.0 - lr * weight_decay,
        beta1,
        beta2,
        eps,
        lr / (1.0 - beta1**step),
        (1.0 - beta2**step) ** 0.5,
        seed_m,
        seed_v,
        STOCHASTIC=exp_avg.dtype == torch.bfloat16,
        COPY=model_copy is not None,
        BLOCK=_BLOCK,
        num_warps=8,
    )
