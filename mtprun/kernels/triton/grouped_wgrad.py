"""`grouped_wgrad_`: the weight gradients of a grouped GEMM, added into a float32 buffer.

For groups e = 0 .. E-1 owning the contiguous rows [start_e, end_e) (start_0 = 0,
start_e = ends[e-1], end_e = ends[e]):
    out[e] += a[start_e:end_e]^T @ b[start_e:end_e]
with a [R, M] and b [R, N] (bf16, or float32) and out [E, M, N] (float32, e.g. megatron-core's
`main_grad` of an expert weight [E, out, in]: a = the output's gradient, b = the input).

Why a kernel: torch's grouped GEMM writes each weight gradient in bf16, which megatron-core's
DDP hook then adds into the float32 main_grad: an extra write, two reads and a launch of the
whole [E, out, in] tensor per micro batch. Here the products accumulate in float32 registers
over the group's rows and each output tile is added to out once, at the end (a float32 out by
vector atomic adds, which L2 carries out while the SM goes on: one adder an element, so the
result is the plain float32 sum, deterministic).

One launch, no host sync: `ends` stays on the device and each program reads its group's
bounds. Programs are numbered group-major (all tiles of a group adjacent), so a group's rows,
a few MB, are read from L2 by all its tiles while they run together. A program whose group has
no rows returns at once (its out tile keeps its value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_wgrad_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    ends_ptr,
    size_m,
    size_n,
    stride_a,
    stride_b,
    stride_oe,
    stride_om,
    TILES_M: tl.constexpr,
    TILES_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Tile (pid_m, pid_n) of group e: out[e, m-block, n-block] += a_e[:, m-block]^T b_e[:, n]."""
    pid = tl.program_id(0)
    group = pid // (TILES_M * TILES_N)
    tile = pid % (TILES_M * TILES_N)
    pid_m = tile // TILES_N
    pid_n = tile % TILES_N
    end = tl.load(ends_ptr + group)
    start = tl.load(ends_ptr + tl.maximum(group - 1, 0), mask=group > 0, other=0)
    if end <= start:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m = offs_m < size_m
    in_n = offs_n < size_n
    # 64-bit: R * M passes 2**31 at a few hundred thousand rows.
    rows = (start + offs_k).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_m[None, :]
    b_ptrs = b_ptr + rows[:, None] * stride_b + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(start, end, BLOCK_K):
        # Rows past end belong to the next group (or lie past R): read as zeros.
        in_k = (k + offs_k) < end
        a = tl.load(a_ptrs, mask=in_k[:, None] & in_m[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
        if UPCAST:  # (exact) the interpreter multiplies bf16's raw bits (Triton <= 3.9)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_a
        b_ptrs += BLOCK_K * stride_b
    out_ptrs = (
        out_ptr
        + group.to(tl.int64) * stride_oe
        + offs_m[:, None].to(tl.int64) * stride_om
        + offs_n[None, :]
    )
    inside = in_m[:, None] & in_n[None, :]
    if ATOMIC:
        # The add done in L2 (red.global.add.v4.f32): the SM sends its tile off like a store
        # and the next program's GEMM overlaps the read-modify-write, where a load would stall
        # this SM on the read (1.8 vs 2.1 ms at 128 x 1536 x 2048 on an H200). One program a
        # tile, one add an element: the same float32 sum as load-add-store, deterministic.
        tl.atomic_add(out_ptrs, acc, mask=inside, sem="relaxed")
    else:
        current = tl.load(out_ptrs, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (current + acc).to(out_ptr.dtype.element_ty), mask=inside)


# Measured on an H200 at the Qwen3-30B-A3B experts' shapes (128 groups of ~1024 rows; M, N =
# 1536, 2048 and 2048, 768): 128 x 128 tiles over 32 rows a step with 4 warps and 5 stages ran
# at ~450 TFLOP/s counting the main_grad update (1.8 and 0.9 ms, against 2.65 and 1.41 ms for
# torch's bf16 grouped GEMM and the add); 64-row steps with 8 warps and 3-4 stages, 128 x 256
# and 256 x 128 tiles, or TMA-loaded operands were 5-20% slower. No triton.autotune: its trials
# would each add into out (main_grad) unless it saved and restored out (1.6 GB here).
NUM_WARPS = 4
NUM_STAGES = 5
BLOCK_M = BLOCK_N = 128
BLOCK_K = 32


def grouped_wgrad_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> None:
    """out [E, M, N] += per group a[start_e:end_e]^T @ b[start_e:end_e], in place.

    a [R, M] and b [R, N] of one dtype (bf16/fp16, or float32: then computed in full float32,
    not TF32), ends [E] int32 (or int64) on their device: the cumulative row counts, ends[-1]
    <= R (the rows past it are read by no group). out: float32 (or any float dtype, the sum is
    float32 and rounded once) with a contiguous last dim, e.g. a weight's `main_grad`.
    Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1.
    """
    groups, m, n = out.shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"a [R, M] and b [R, N] expected, got {tuple(a.shape)}, {tuple(b.shape)}")
    if (a.shape[1], b.shape[1]) != (m, n) or ends.shape != (groups,):
        raise ValueError(
            f"out {tuple(out.shape)} does not fit a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"ends {tuple(ends.shape)}"
        )
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if out.stride(-1) != 1:
        raise ValueError("out's last dim must be contiguous")
    if groups == 0 or m == 0 or n == 0 or a.shape[0] == 0:
        return
    a, b, ends = a.contiguous(), b.contiguous(), ends.contiguous()
    tiles_m, tiles_n = triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)
    grouped_wgrad_kernel[(groups * tiles_m * tiles_n,)](
        a,
        b,
        out,
        ends,
        m,
        n,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        TILES_M=tiles_m,
        TILES_N=tiles_n,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=a.is_cpu,
        ATOMIC=out.dtype == torch.float32,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
