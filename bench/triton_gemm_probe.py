"""Can a Triton GEMM carry the head loss's row statistics at cuBLAS speed? (issue 7, 100%/50%)

    python bench/triton_gemm_probe.py

The chunked head loss is the three cuBLAS GEMMs plus a memory-bound row kernel (three passes
over the bf16 logits, ~6% of the GEMM floor at 100% active). Hiding that kernel means
computing the row statistics in the logits GEMM's epilogue (and dz in the gradient GEMMs'
operand loads), which cuBLAS cannot do. This times a persistent TMA Triton GEMM for the
logits shape [M, H] x [V, H]^T -> bf16 [M, V], with and without an epilogue that writes each
tile's row max and sum of exp, against `torch.mm` (cuBLAS) at the same shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from head_loss_gpu import timed_ms


@triton.jit
def logits_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    stats_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NUM_SMS: tl.constexpr,
    STATS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """C = A @ B^T, tiles in M-fastest order (CTAs at work share B tiles through L2); with
    STATS each tile also writes its rows' max and sum of exp to stats [M, cdiv(N, BN), 2]."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(
        tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m = tile % num_m
        pid_n = tile // num_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([pid_m * BM, kk * BK])
            b = b_desc.load([pid_n * BN, kk * BK])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))
        if STATS:
            cols = pid_n * BN + tl.arange(0, BN)
            z = tl.where((cols < N)[None, :], acc, -float("inf"))
            row_max = tl.max(z, 1)
            row_sum = tl.sum(tl.exp(z - row_max[:, None]), 1)
            rows = pid_m * BM + tl.arange(0, BM)
            out = stats_ptr + (rows.to(tl.int64) * num_n + pid_n) * 2
            tl.store(out, row_max, mask=rows < M)
            tl.store(out + 1, row_sum, mask=rows < M)


@triton.jit
def weight_grad_kernel(
    dz_desc,
    h_desc,
    c_desc,
    c_ptr,
    V,
    H,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NUM_SMS: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # 0: C = ..., 1: C += ... with C through TMA, 2: C in registers
    WARP_SPECIALIZE: tl.constexpr,
):
    """C[V, H] (+)= dz[K, V]^T @ h[K, H], bf16 C, float32 accumulation (the weight gradient
    of one row chunk, K = its rows)."""
    num_m = tl.cdiv(V, BM)
    num_n = tl.cdiv(H, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(
        tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        pid_n = tile % num_n
        pid_m = tile // num_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            a = dz_desc.load([kk * BK, pid_m * BM])
            b = h_desc.load([kk * BK, pid_n * BN])
            acc = tl.dot(a.T, b, acc)
        if ACCUMULATE == 1:  # C through shared memory (a TMA load)
            acc += c_desc.load([pid_m * BM, pid_n * BN]).to(tl.float32)
        if ACCUMULATE == 2:  # C straight into registers (no shared memory for it)
            rows = pid_m * BM + tl.arange(0, BM)
            cols = pid_n * BN + tl.arange(0, BN)
            inside = (rows < V)[:, None] & (cols < H)[None, :]
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :]
            acc += tl.load(c_ptrs, mask=inside, other=0.0).to(tl.float32)
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


def timed_us(fn, reps: int) -> float:
    return timed_ms(fn, reps=reps, warmup=3) * 1e3


CONFIGS = [  # BM, BN, BK, stages, warps
    (128, 256, 64, 3, 8),
    (128, 256, 64, 4, 8),
    (128, 128, 64, 4, 8),
    (128, 128, 64, 5, 4),
    (256, 128, 64, 3, 8),
]


def _device_allocator(size: int, align: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def triton_logits(a, w, c, config, *, stats: bool, warp_specialize: bool):
    """A launcher of logits_gemm_kernel for one config (descriptors built once)."""
    bm, bn, bk, stages, warps = config
    m, n, k = a.shape[0], w.shape[0], a.shape[1]
    out = torch.empty(m, triton.cdiv(n, bn), 2, device="cuda")
    descs = (
        TensorDescriptor.from_tensor(a, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(c, [bm, bn]),
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    constexprs = dict(BM=bm, BN=bn, BK=bk, NUM_SMS=sms, STATS=stats)
    options = dict(WARP_SPECIALIZE=warp_specialize, num_stages=stages, num_warps=warps)

    def run() -> None:
        logits_gemm_kernel[(sms,)](*descs, out, m, n, k, **constexprs, **options)

    return run


def probe_shape(m: int, w: torch.Tensor, reps: int) -> None:
    a = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, w.shape[0], device="cuda", dtype=torch.bfloat16)
    flop = 2 * m * w.shape[1] * w.shape[0]
    cublas = timed_us(lambda: torch.mm(a, w.t(), out=c), reps)
    reference = c.float()
    print(f"M={m}: cuBLAS {cublas:.0f} us ({flop / cublas / 1e6:.0f} TFLOP/s)", flush=True)
    for config in CONFIGS:
        for stats in (False, True):
            for ws in (False, True):
                label = "  {}x{}x{} s{} w{}".format(*config) + f" stats={stats:d} ws={ws:d}"
                try:
                    run = triton_logits(a, w, c, config, stats=stats, warp_specialize=ws)
                    c.zero_()
                    run()
                    error = (c.float() - reference).abs().max().item()
                    us = timed_us(run, reps)
                except Exception as exc:  # a config that does not compile is a result
                    print(f"{label}: failed: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                print(
                    f"{label}: {us:.0f} us ({flop / us / 1e6:.0f} TFLOP/s, "
                    f"{us / cublas:.3f}x cuBLAS), max |diff| {error:.2e}",
                    flush=True,
                )


def probe_weight_grad(k: int, w: torch.Tensor, reps: int) -> None:
    v, h = w.shape
    dz = torch.randn(k, v, device="cuda", dtype=torch.bfloat16) * 1e-3
    rows = torch.randn(k, h, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    flop = 2 * k * h * v
    start = grad.clone()
    cublas = timed_us(lambda: grad.addmm_(dz.t(), rows), reps)
    grad.copy_(start)
    grad.addmm_(dz.t(), rows)
    reference = grad.float()
    print(f"grad_W K={k}: cuBLAS addmm_ {cublas:.0f} us ({flop / cublas / 1e6:.0f} TFLOP/s)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [
        (128, 256, 64, 3, 8, 2),
        (256, 128, 64, 3, 8, 2),
        (128, 256, 64, 2, 8, 1),
        (128, 256, 32, 4, 8, 1),
        (128, 256, 32, 4, 8, 2),
        (128, 128, 64, 4, 8, 2),
    ]
    for bm, bn, bk, stages, warps, accumulate in variants:
        descs = (
            TensorDescriptor.from_tensor(dz, [bk, bm]),
            TensorDescriptor.from_tensor(rows, [bk, bn]),
            TensorDescriptor.from_tensor(grad, [bm, bn]),
        )
        for ws in (False, True):
            label = f"  {bm}x{bn}x{bk} s{stages} w{warps} C={accumulate} ws={ws:d}"
            kwargs = dict(BM=bm, BN=bn, BK=bk, NUM_SMS=sms, ACCUMULATE=accumulate)
            kwargs |= dict(WARP_SPECIALIZE=ws, num_stages=stages, num_warps=warps)

            def run(descs=descs, kwargs=kwargs) -> None:
                weight_grad_kernel[(sms,)](*descs, grad, v, h, k, **kwargs)

            try:
                grad.copy_(start)
                run()
                error = (grad.float() - reference).abs().max().item()
                us = timed_us(run, reps)
            except Exception as exc:
                print(f"{label}: failed: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            print(
                f"{label}: {us:.0f} us ({flop / us / 1e6:.0f} TFLOP/s, {us / cublas:.3f}x cuBLAS),"
                f" max |diff| {error:.2e}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="*", default=[2560, 16384])
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--grad-k", type=int, nargs="*", default=[2560])
    args = parser.parse_args()
    triton.set_allocator(_device_allocator)
    w = torch.randn(args.v, args.h, device="cuda", dtype=torch.bfloat16) * args.h**-0.5
    for m in args.m:
        probe_shape(m, w, args.reps)
    for k in args.grad_k:
        probe_weight_grad(k, w, args.reps)


if __name__ == "__main__":
    main()
