"""GPU benchmark of the fused head loss against its peers, forward + backward, in one run.

    python bench/head_loss_gpu.py            # the issue-7 protocol on one H100 (a few minutes)

Workloads (N = 4 x 4096 tokens, H = 4096, V = 151936, bf16), each at 100%, 50% and 3% of the
rows under the loss mask:
  sft:  CE + z-loss 1e-4
  grpo: GRPO clip + k3 KL to a reference (+ the entropy metric)
  mtp:  CE + a depth-1 MTP head with the soft target and the tied output weight
Peers: plain torch (materialized logits, one pass per term), plain torch on the mask-filtered
rows, Liger-Kernel (fused linear CE with lse_square_scale; fused linear GRPO),
cut-cross-entropy (CE only), "monolithic" (all active rows' bf16 logits at once, one per-row
kernel: the design of Fast-LLM's monolithic loss, run with mtprun's kernel) and mtprun.
Wheels of liger-kernel 0.8.5 and cut-cross-entropy 25.1.1 must be importable.
Reported: median ms of CUDA-event-timed steps, peak memory above the inputs (gradients
included), and the ratio to the GEMM floor 6 * N_active * H * V / measured bf16 GEMM rate
(x2 for mtp: two heads).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtprun import HeadInputs, HeadPlan, head_loss

GiB = 1 << 30
SEQUENCES = 4
PLANS = {
    "sft": [{"kind": "ce"}, {"kind": "z_loss", "weight": 1e-4}],
    "grpo": [
        {"kind": "grpo", "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.04, "kl_estimator": "k3"},
        {"kind": "entropy", "coef": 0.0},
    ],
    "mtp": [{"kind": "ce"}, {"kind": "mtp", "depth": 1, "target": "soft"}],
}


@dataclass
class Cell:
    workload: str
    active: float
    peer: str
    ms: float | None
    peak_gib: float | None
    floor_ms: float
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.ms is None else self.ms / self.floor_ms


def timed_ms(step: Callable[[], None], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_above_inputs_gib(step: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def measure_ceilings(n: int, h: int, v: int) -> dict[str, float]:
    """bf16 GEMM rate at the logits GEMM's shape, the three-GEMM chain, copy bandwidth."""
    a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    ms = timed_ms(lambda: torch.mm(a, w.t()), reps=10, warmup=3)
    buffers = {"logits": torch.mm(a, w.t()), "grad_w": torch.empty_like(w)}

    def chain() -> None:
        torch.mm(a, w.t(), out=buffers["logits"])
        torch.mm(buffers["logits"], w)
        torch.mm(buffers["logits"].t(), a, out=buffers["grad_w"])

    chain_ms = timed_ms(chain, reps=5, warmup=2)
    buffers.clear()
    src = torch.randn(GiB, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    copy_ms = timed_ms(lambda: dst.copy_(src), reps=10, warmup=3)
    return {
        "gemm_tflops": 2 * n * h * v / ms / 1e9,
        "three_gemm_ms": chain_ms,
        "copy_tb_s": 2 * src.numel() * 4 / copy_ms / 1e9,
    }


def make_inputs(workload: str, active: float, n: int, h: int, v: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=gen) * scale
        return x.to(torch.bfloat16).requires_grad_()

    inputs = {
        "hidden": randn(n, h),
        "weight": randn(v, h, scale=h**-0.5),
        "targets": torch.randint(0, v, (n,), device="cuda", generator=gen),
        "loss_mask": torch.rand(n, device="cuda", generator=gen) < active,
        "cu_seqlens": torch.arange(0, n + 1, n // SEQUENCES, device="cuda"),
    }
    if workload == "grpo":
        per_seq = torch.randn(SEQUENCES, device="cuda", generator=gen)
        inputs["advantages"] = per_seq.repeat_interleave(n // SEQUENCES)
        inputs["old_logprobs"] = -torch.rand(n, device="cuda", generator=gen) * 4 - 8
        inputs["ref_logprobs"] = -torch.rand(n, device="cuda", generator=gen) * 4 - 8
    if workload == "mtp":
        inputs["mtp_hidden"] = [randn(n, h)]
    return inputs


def _leaves(inputs: dict) -> list[torch.Tensor]:
    return [inputs["hidden"], inputs["weight"], *inputs.get("mtp_hidden", [])]


def _with_fresh_grads(loss_fn: Callable[[], torch.Tensor], inputs: dict) -> Callable[[], None]:
    def step() -> None:
        for leaf in _leaves(inputs):
            leaf.grad = None
        loss_fn().backward()

    return step


# ---- peers ---------------------------------------------------------------------------------


def mtprun_step(workload: str, inputs: dict, chunk_bytes: int | None) -> Callable[[], None]:
    plan = HeadPlan.from_losses(PLANS[workload])
    kwargs = {k: inputs[k] for k in inputs if k not in ("hidden", "weight")}

    def checked() -> HeadInputs:  # checked in every step, as the trainer does
        return HeadInputs.build(plan, inputs["hidden"], inputs["weight"], **kwargs)

    if chunk_bytes is not None:
        from mtprun.kernels.triton import triton_head_loss

        def loss() -> torch.Tensor:
            return triton_head_loss(checked(), chunk_bytes=chunk_bytes).loss

    else:

        def loss() -> torch.Tensor:
            return head_loss(checked()).loss

    return _with_fresh_grads(loss, inputs)


def torch_step(workload: str, inputs: dict, filtered: bool) -> Callable[[], None]:
    """Materialized float32 logits, one pass per term (how most trainers do it)."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x[inputs["loss_mask"]] if filtered else x

    def loss() -> torch.Tensor:
        mask = rows(inputs["loss_mask"]).float()
        count = mask.sum().clamp(min=1)
        logits = (rows(inputs["hidden"]) @ inputs["weight"].t()).float()
        targets = rows(inputs["targets"])
        if workload == "sft":
            ce = F.cross_entropy(logits, targets, reduction="none")
            z = torch.logsumexp(logits, dim=-1) ** 2
            return ((ce + 1e-4 * z) * mask).sum() / count
        if workload == "grpo":
            logp_all = logits.log_softmax(-1)
            logp = logp_all.gather(1, targets[:, None]).squeeze(1)
            with torch.no_grad():  # the entropy metric, its own pass
                _ = (-(logp_all.exp() * logp_all).sum(-1) * mask).sum() / count
            ratio = torch.exp(logp - rows(inputs["old_logprobs"]))
            adv = rows(inputs["advantages"])
            pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
            delta = rows(inputs["ref_logprobs"]) - logp
            kl = torch.exp(delta) - delta - 1
            return ((pg + 0.04 * kl) * mask).sum() / count
        ce = F.cross_entropy(logits, targets, reduction="none")
        policy = (ce * mask).sum() / count
        return policy + 0.3 * _torch_mtp(inputs, logits.detach(), filtered)

    return _with_fresh_grads(loss, inputs)


def _torch_mtp(inputs: dict, policy_logits: torch.Tensor, filtered: bool) -> torch.Tensor:
    """Depth-1 soft draft loss: row t taught by the detached policy row t+1."""
    mask, cu = inputs["loss_mask"], inputs["cu_seqlens"]
    n = mask.shape[0]
    seq = torch.searchsorted(cu[1:], torch.arange(n, device=mask.device), right=True)
    valid = mask[:-1] & mask[1:] & (seq[:-1] == seq[1:])
    draft_hidden = inputs["mtp_hidden"][0][:-1]
    weight = inputs["weight"].detach()
    if filtered:
        teacher_rows = (torch.cumsum(mask.long(), 0) - 1)[1:][valid]
        draft_logits = (draft_hidden[valid] @ weight.t()).float()
        teacher = policy_logits[teacher_rows].softmax(-1)
        per_token = -(teacher * draft_logits.log_softmax(-1)).sum(-1)
        return per_token.sum() / valid.sum().clamp(min=1)
    draft_logits = (draft_hidden @ weight.t()).float()
    teacher = policy_logits[1:].softmax(-1)
    per_token = -(teacher * draft_logits.log_softmax(-1)).sum(-1)
    return (per_token * valid).sum() / valid.sum().clamp(min=1)


def liger_step(workload: str, inputs: dict) -> Callable[[], None]:
    if workload == "sft":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        targets = torch.where(inputs["loss_mask"], inputs["targets"], -100)

        def loss() -> torch.Tensor:
            return liger_fused_linear_cross_entropy(
                inputs["hidden"], inputs["weight"], targets, lse_square_scale=1e-4
            )

        return _with_fresh_grads(loss, inputs)
    if workload == "grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        grpo = LigerFusedLinearGRPOLoss(
            beta=0.04, epsilon_low=0.2, epsilon_high=0.28, use_ref_model=True
        )
        b, t = SEQUENCES, inputs["hidden"].shape[0] // SEQUENCES

        def loss() -> torch.Tensor:
            out = grpo(
                inputs["hidden"].view(b, t, -1),
                inputs["weight"],
                inputs["targets"].view(b, t),
                inputs["loss_mask"].view(b, t).long(),
                inputs["advantages"].view(b, t)[:, 0],
                ref_per_token_logps=inputs["ref_logprobs"].view(b, t),
                old_per_token_logps=inputs["old_logprobs"].view(b, t),
            )
            return out[0] if isinstance(out, tuple) else out

        return _with_fresh_grads(loss, inputs)
    raise NotImplementedError("Liger-Kernel has no MTP soft-target loss")


def cce_step(workload: str, inputs: dict) -> Callable[[], None]:
    if workload != "sft":
        raise NotImplementedError("cut-cross-entropy computes CE only")
    from cut_cross_entropy import linear_cross_entropy

    targets = torch.where(inputs["loss_mask"], inputs["targets"], -100)

    def loss() -> torch.Tensor:  # CE only: cut-cross-entropy has no z-loss
        return linear_cross_entropy(inputs["hidden"], inputs["weight"], targets)

    return _with_fresh_grads(loss, inputs)


def make_peers(chunk_mib: list[int]) -> dict[str, Callable[[str, dict], Callable[[], None]]]:
    peers: dict[str, Callable[[str, dict], Callable[[], None]]] = {
        "torch": lambda w, i: torch_step(w, i, filtered=False),
        "torch-filtered": lambda w, i: torch_step(w, i, filtered=True),
        "liger": liger_step,
        "cce": cce_step,
        # The strongest design of the issue (Fast-LLM's monolithic loss kernel): all active
        # rows' bf16 logits materialized at once, one per-row kernel, one GEMM per gradient.
        # Stood in for by mtprun's own kernel with a single chunk.
        "monolithic": lambda w, i: mtprun_step(w, i, 1 << 40),
        "mtprun": lambda w, i: mtprun_step(w, i, None),
    }
    for mib in chunk_mib:
        peers[f"mtprun@{mib}MiB"] = lambda w, i, mib=mib: mtprun_step(w, i, mib << 20)
    return peers


def run_cell(peer: Callable[[], None], reps: int, warmup: int) -> tuple[float, float]:
    peak = peak_above_inputs_gib(peer)  # also compiles / warms up
    return timed_ms(peer, reps=reps, warmup=warmup), peak


def kernel_table(step: Callable[[], None], trace: Path | None = None) -> str:
    """CUDA and host time per op over one step (where the time goes); `trace`: also write
    the step's timeline there (chrome://tracing, Perfetto) to see where the GPU idles."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    return "\n".join(
        events.table(sort_by=key, row_limit=12, max_name_column_width=60)
        for key in ("cuda_time_total", "cpu_time_total")
    )


def gemm_sweep(h: int, v: int) -> None:
    """TFLOP/s of the three per-chunk GEMMs at several chunk heights (chooses the chunk)."""
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    grad_w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    print("| rows | logits | grad_h | grad_W += | grad_W^T += |\n|---|---|---|---|---|")
    for rows in (1024, 2048, 2560, 3072, 4096):
        rates = _chunk_gemm_rates(rows, weight, grad_w)
        print(f"| {rows} | " + " | ".join(f"{r:.0f}" for r in rates) + " |", flush=True)


def _chunk_gemm_rates(rows: int, weight: torch.Tensor, grad_w: torch.Tensor) -> list[float]:
    v, h = weight.shape
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    dz = torch.randn(rows, v, device="cuda", dtype=torch.bfloat16)
    grad_wt = torch.randn(h, v, device="cuda", dtype=torch.bfloat16)
    cases = (
        lambda: torch.mm(x, weight.t(), out=dz),
        lambda: torch.mm(dz, weight),
        lambda: grad_w.addmm_(dz.t(), x),
        lambda: grad_wt.addmm_(x.t(), dz),
    )
    return [2 * rows * h * v / 1e9 / timed_ms(case, reps=10, warmup=3) for case in cases]


def kernel_sweep(h: int, v: int, rows: int = 2560) -> None:
    """Bandwidth of the sft row kernel (3 passes) over tile widths and warps."""
    from mtprun.kernels.row_groups import row_groups
    from mtprun.kernels.triton import groups, launch

    plan = HeadPlan.from_losses(PLANS["sft"])
    hidden = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
    targets = torch.randint(0, v, (rows,), device="cuda")
    mask = torch.ones(rows, dtype=torch.bool, device="cuda")
    inputs = HeadInputs.build(plan, hidden, weight, targets=targets, loss_mask=mask)
    group = groups.build(row_groups(plan, inputs)[0], inputs, argmax=False)
    logits = hidden @ weight.t()
    gbytes = 3 * logits.numel() * logits.element_size() / 1e9
    defaults = launch.MAX_BLOCK_V, launch.NUM_WARPS
    print("| BLOCK_V | warps | ms | TB/s |\n|---|---|---|---|")
    for block in (2048, 4096, 8192):
        for warps in (4, 8, 16):
            launch.MAX_BLOCK_V, launch.NUM_WARPS = block, warps
            ms = timed_ms(lambda: launch.run_rows(logits, group, 0, rows, vocab_offset=0), 10, 2)
            print(f"| {block} | {warps} | {ms:.3f} | {gbytes / ms:.2f} |", flush=True)
    launch.MAX_BLOCK_V, launch.NUM_WARPS = defaults


def tp_main(args: argparse.Namespace) -> None:
    """Vocab-parallel run (torchrun, one process per GPU): TP=world against TP=1 on the same
    inputs (loss and gradients), then the time per step on each rank."""
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    if dist.get_rank() == 0:
        print(f"device: {torch.cuda.get_device_name()} x {dist.get_world_size()}")
        print(
            "| rank | workload | active | loss TP | loss TP=1 | grad rel. err. vs TP=1 "
            "(hidden, weight shard, mtp) | ms/step TP | ms/step TP=1 |\n"
            "|---|---|---|---|---|---|---|---|",
            flush=True,
        )
    for workload in args.workloads:
        for active in args.active:
            print(_tp_cell(workload, active, args, dist.group.WORLD), flush=True)
    dist.destroy_process_group()


def _tp_cell(workload: str, active: float, args: argparse.Namespace, group) -> str:
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = make_inputs(workload, active, args.n, args.h, args.v, seed=7)
    kwargs = {k: inputs[k] for k in inputs if k not in ("hidden", "weight")}
    shard = args.v // world
    local = inputs["weight"][rank * shard : (rank + 1) * shard].detach().clone()
    local_inputs = inputs | {"weight": local.requires_grad_()}
    tp_plan = HeadPlan.from_losses(PLANS[workload], tp_size=world)
    one_plan = HeadPlan.from_losses(PLANS[workload])

    def tp_loss() -> torch.Tensor:
        checked = HeadInputs.build(tp_plan, inputs["hidden"], local, **kwargs, tp_group=group)
        return head_loss(checked).loss

    def one_loss() -> torch.Tensor:
        return head_loss(
            HeadInputs.build(one_plan, inputs["hidden"], inputs["weight"], **kwargs)
        ).loss

    one_step = _with_fresh_grads(one_loss, inputs)
    tp_step = _with_fresh_grads(tp_loss, local_inputs)
    one_step()
    expected = [t.grad.clone() for t in _leaves(inputs)]
    expected[1] = expected[1][rank * shard : (rank + 1) * shard]
    tp_step()
    got = [t.grad.clone() for t in _leaves(local_inputs)]
    errors = ", ".join(f"{_relative(a, b):.1e}" for a, b in zip(got, expected, strict=True))
    with torch.no_grad():
        losses = float(tp_loss()), float(one_loss())
    tp_ms, one_ms = timed_ms(tp_step, 8, 1), timed_ms(one_step, 8, 1)
    return (
        f"| {rank}/{world} | {workload} | {active:.0%} | {losses[0]:.6f} | {losses[1]:.6f} | "
        f"{errors} | {tp_ms:.1f} | {one_ms:.1f} |"
    )


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--workloads", nargs="+", default=list(PLANS))
    parser.add_argument("--active", nargs="+", type=float, default=[1.0, 0.5, 0.03])
    parser.add_argument("--peers", nargs="+", default=None, help="default: all")
    parser.add_argument(
        "--chunk-mib", nargs="*", type=int, default=[], help="mtprun chunk budgets to compare"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print mtprun's CUDA kernel times per cell"
    )
    parser.add_argument(
        "--trace", type=Path, default=None, help="with --profile: a timeline per cell here"
    )
    parser.add_argument(
        "--sweeps", action="store_true", help="GEMM rates per chunk height, row-kernel tiles"
    )
    parser.add_argument(
        "--tp", action="store_true", help="vocab-parallel check and timing (under torchrun)"
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write all cells here")
    args = parser.parse_args()

    if args.tp:
        tp_main(args)
        return
    device = torch.cuda.get_device_name()
    ceilings = measure_ceilings(args.n, args.h, args.v)
    print(f"device: {device}; torch {torch.__version__}", flush=True)
    print(
        f"ceilings: bf16 GEMM {ceilings['gemm_tflops']:.0f} TFLOP/s at [{args.n}x{args.h}] x "
        f"[{args.h}x{args.v}]; fwd+2 grad GEMMs {ceilings['three_gemm_ms']:.1f} ms; "
        f"copy {ceilings['copy_tb_s']:.2f} TB/s",
        flush=True,
    )
    if args.sweeps:
        gemm_sweep(args.h, args.v)
        kernel_sweep(args.h, args.v)
    peers = make_peers(args.chunk_mib)
    selected = args.peers or list(peers)
    cells: list[Cell] = []
    for workload in args.workloads:
        heads = 2 if workload == "mtp" else 1
        for active in args.active:
            inputs = make_inputs(workload, active, args.n, args.h, args.v, seed=len(cells))
            n_active = int(inputs["loss_mask"].sum())
            flops = 6 * n_active * args.h * args.v * heads
            floor_ms = flops / (ceilings["gemm_tflops"] * 1e12) * 1e3
            for name in selected:
                cell = Cell(workload, active, name, None, None, floor_ms)
                try:
                    step = peers[name](workload, inputs)
                    cell.ms, cell.peak_gib = run_cell(step, args.reps, args.warmup)
                    if args.profile and name.startswith("mtprun"):
                        trace = None
                        if args.trace is not None:
                            trace = args.trace / f"{workload}_{active:g}_{name}.json"
                        print(kernel_table(step, trace), flush=True)
                except NotImplementedError as exc:
                    cell.note = f"n/a: {exc}"
                except torch.cuda.OutOfMemoryError:
                    cell.note = "out of memory"
                except Exception as exc:  # a peer's failure must not end the run
                    cell.note = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                for leaf in _leaves(inputs):
                    leaf.grad = None
                gc.collect()
                torch.cuda.empty_cache()
                cells.append(cell)
                print(_row(cell), flush=True)
            del inputs
            gc.collect()
            torch.cuda.empty_cache()

    print("\n| workload | active | peer | ms | peak GiB | x floor | note |")
    print("|---|---|---|---|---|---|---|")
    for cell in cells:
        print(_row(cell))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "torch": torch.__version__,
                    "shape": {"n": args.n, "h": args.h, "v": args.v},
                    "ceilings": ceilings,
                    "cells": [asdict(c) | {"ratio": c.ratio} for c in cells],
                },
                indent=1,
            )
        )


def _row(cell: Cell) -> str:
    ms = "-" if cell.ms is None else f"{cell.ms:.1f}"
    peak = "-" if cell.peak_gib is None else f"{cell.peak_gib:.2f}"
    ratio = "-" if cell.ratio is None else f"{cell.ratio:.2f}"
    return (
        f"| {cell.workload} | {cell.active:.0%} | {cell.peer} | {ms} | {peak} | {ratio} | "
        f"{cell.note} |"
    )


if __name__ == "__main__":
    main()
