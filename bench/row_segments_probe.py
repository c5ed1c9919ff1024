"""Does a one-read row kernel beat the two-pass one? And can cuBLAS leave SMs to it? (issue 7)

    python bench/row_segments_probe.py

The product's row kernel gives each logits row to one program, which reads the row twice
(statistics, then dz) and writes it once: 6 bytes per logit. Here each row is split into
segments of BLOCK_V logits, one program per segment holding its segment in registers: it
writes its segment's partial statistics, waits (spinning on a per-row arrival counter) until
every segment of the row has, combines them, and writes dz from its registers: 4 bytes per
logit. With `ticket`, programs take their (row, segment) from a counter in the order they
start, so every segment whose owner waits has an owner that runs (no deadlock for any
dispatch order, as long as one row's segments fit on the GPU at once); without it the
program id is used, which relies on programs starting in id order. The probe's kernel
carries only cross-entropy + z-loss (the sft workload) and is checked against the product's.

Second part: three logits GEMMs with `torch._C._set_sm_carveout_experimental(k)` (cuBLAS
asked to leave k SMs free), alone and with the segment kernel on a low-priority stream.
Outcome (run21/run22 logs): see bench/triton_notes.md, v7.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from head_loss_gpu import PLANS, timed_ms

from mtprun.compiler import HeadPlan
from mtprun.kernels.inputs import row_groups, validate
from mtprun.kernels.triton import groups, launch


@triton.jit
def sft_segments_kernel(
    logits_ptr,
    stride_row,
    vocab,
    targets_ptr,
    w_ce_ptr,
    w_z_ptr,
    partials_ptr,
    counters_ptr,
    n_programs,
    SEGMENTS: tl.constexpr,
    SEGMENTS_P2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    TICKET: tl.constexpr,
):
    if TICKET:
        ticket = tl.atomic_add(counters_ptr, 1)
        if ticket == n_programs - 1:  # the last ticket: reset for the next launch
            tl.atomic_xchg(counters_ptr, 0)
    else:  # relies on programs starting in program-id order
        ticket = tl.program_id(0)
    row = ticket // SEGMENTS
    seg = ticket % SEGMENTS
    cols = seg * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < vocab
    row64 = row.to(tl.int64)
    row_ptr = logits_ptr + row64 * stride_row
    z = tl.load(row_ptr + cols, mask=valid, other=-float("inf")).to(tl.float32)
    target = tl.load(targets_ptr + row)
    m = tl.max(z, 0)
    e = tl.where(valid, tl.exp(z - m), 0.0)
    s = tl.sum(e, 0)
    part = partials_ptr + (row64 * SEGMENTS + seg) * 4
    tl.store(part + 0, m)
    tl.store(part + 1, s)
    tl.debug_barrier()
    arrivals = counters_ptr + 1 + row
    seen = tl.atomic_add(arrivals, 1, sem="release") + 1
    while seen < SEGMENTS:
        seen = tl.atomic_add(arrivals, 0, sem="acquire")
    segs = tl.arange(0, SEGMENTS_P2)
    mine = segs < SEGMENTS
    base = partials_ptr + (row64 * SEGMENTS + segs) * 4
    ms = tl.load(base + 0, mask=mine, other=-float("inf"), cache_modifier=".cg")
    ss = tl.load(base + 1, mask=mine, other=0.0, cache_modifier=".cg")
    m_all = tl.max(ms, 0)
    s_all = tl.sum(ss * tl.exp(ms - m_all), 0)
    lse = m_all + tl.log(s_all)
    w_ce = tl.load(w_ce_ptr + row)
    w_z = tl.load(w_z_ptr + row)
    a = w_ce + 2.0 * w_z * lse
    dz = a * tl.exp(z - lse) - tl.where(cols == target, w_ce, 0.0)
    tl.store(row_ptr + cols, dz.to(logits_ptr.dtype.element_ty), mask=valid)
    if seg == 0:
        tl.store(partials_ptr + row64 * SEGMENTS * 4 + 3, lse)  # checked against the product


def run_segments(logits, targets, w_ce, w_z, block, warps, scratch, ticket=True):
    rows, vocab = logits.shape
    segments = triton.cdiv(vocab, block)
    partials, counters = scratch
    counters[1 : 1 + rows].zero_()
    sft_segments_kernel[(rows * segments,)](
        logits,
        logits.stride(0),
        vocab,
        targets,
        w_ce,
        w_z,
        partials,
        counters,
        rows * segments,
        SEGMENTS=segments,
        SEGMENTS_P2=triton.next_power_of_2(segments),
        BLOCK_V=block,
        TICKET=ticket,
        num_warps=warps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2560)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rows, h, v = args.rows, args.h, args.v
    torch.manual_seed(0)
    hidden = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
    targets = torch.randint(0, v, (rows,), device="cuda")
    mask = torch.ones(rows, dtype=torch.bool, device="cuda")
    plan = HeadPlan.from_losses(PLANS["sft"])
    inputs = validate(plan, hidden, weight, targets=targets, loss_mask=mask)
    group = groups.build(row_groups(plan, inputs)[0], inputs, argmax=False)
    logits = hidden @ weight.t()
    gbytes6 = 3 * logits.numel() * 2 / 1e9
    gbytes4 = 2 * logits.numel() * 2 / 1e9

    product = logits.clone()
    launch.run_rows(product, group, 0, rows, vocab_offset=0)
    lse_product = group.values[:, 2].clone()
    w_ce = group.weights[:, 0].contiguous()
    w_z = group.weights[:, 1].contiguous()
    print(f"device: {torch.cuda.get_device_name()}; rows {rows}, V {v}")
    work = logits.clone()
    product_ms = timed_ms(
        lambda: launch.run_rows(work, group, 0, rows, vocab_offset=0), args.reps, 3
    )
    print(f"product two-pass kernel: {product_ms:.3f} ms, {gbytes6 / product_ms:.2f} TB/s")
    print("| BLOCK_V | warps | ticket | ms | TB/s (4 B/logit) | max abs dz - product | lse err |")
    print("|---|---|---|---|---|---|---|")
    best = None
    configs = [(2048, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
    for (block, warps), ticket in itertools.product(configs, (True, False)):
        segments = triton.cdiv(v, block)
        scratch = (
            torch.empty(rows * segments * 4, device="cuda", dtype=torch.float32),
            torch.zeros(rows + 1, device="cuda", dtype=torch.int32),
        )
        out = logits.clone()
        run_segments(out, targets, w_ce, w_z, block, warps, scratch, ticket)
        torch.cuda.synchronize()
        err = (out.float() - product.float()).abs().max().item()
        lse = scratch[0].view(rows, segments, 4)[:, 0, 3]
        lse_err = (lse - lse_product).abs().max().item()

        def segment_rows(b=block, w=warps, s=scratch, t=ticket):
            run_segments(work, targets, w_ce, w_z, b, w, s, t)

        ms = timed_ms(segment_rows, args.reps, 3)
        cells = f"{ms:.3f} | {gbytes4 / ms:.2f} | {err:.2e} | {lse_err:.2e}"
        print(f"| {block} | {warps} | {ticket} | {cells} |", flush=True)
        if best is None or ms < best[0]:
            best = (ms, segment_rows)
    carveout(hidden, weight, logits, best, args.reps)


def carveout(hidden, weight, logits, best, reps) -> None:
    """Three logits GEMMs with k SMs left to the segment kernel on a low-priority stream.
    The carveout reaches cuBLASLt only, hence both BLAS back ends."""
    rows_ms, segment_rows = best
    high = torch.cuda.Stream(priority=-1)
    low = torch.cuda.Stream(priority=0)
    out = torch.empty_like(logits)
    print(f"\nfastest segment kernel alone: {rows_ms:.3f} ms")
    print("| BLAS | carveout SMs | GEMM ms | 3 GEMMs + rows beside ms | serial sum ms |")
    print("|---|---|---|---|---|")
    for library, k in itertools.product(("cublas", "cublaslt"), (0, 8, 16)):
        torch.backends.cuda.preferred_blas_library(library)
        torch._C._set_sm_carveout_experimental(k if k else None)

        def gemm():
            torch.mm(hidden, weight.t(), out=out)

        def both():
            main = torch.cuda.current_stream()
            high.wait_stream(main)
            low.wait_stream(main)
            with torch.cuda.stream(high):
                for _ in range(3):
                    gemm()
            with torch.cuda.stream(low):
                segment_rows()
            main.wait_stream(high)
            main.wait_stream(low)

        gemm_ms = timed_ms(gemm, reps, 3)
        both_ms = timed_ms(both, reps, 3)
        serial = 3 * gemm_ms + rows_ms
        print(f"| {library} | {k} | {gemm_ms:.3f} | {both_ms:.3f} | {serial:.3f} |", flush=True)
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
