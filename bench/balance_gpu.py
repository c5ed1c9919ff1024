"""Data-parallel balance of long-tailed RL steps on GPUs (issue 35, target (a)): the step time
of dp replicas training one GRPO step whose sequence lengths are long-tailed, laid out three
ways, against a uniform-length step of the same tokens.

Each draw takes log-normal lengths (median --median, sigma --sigma, capped at --cap:
bench/balance_cpu.py's `draw_lengths`) until the step holds dp x --tokens-per-rank tokens of random
ids, and lays the step out as
- uniform: every sequence of the draw's mean length (the same tokens and count), laid out by
  `rebalance` (equal shares: the reference no layout of the draw can beat by much);
- unbalanced: the drawn lengths in rollout order, packed in order, dealt round-robin (mtprun's
  layout with `trainer.balance: false`);
- balanced: `mtprun.data.balance.rebalance`, as a GRPO step lays it out by default.
Every rank builds the same layouts (seeded) and trains its share with `Trainer.train_step`
(one optimizer step, the gradients summed over the replicas inside it). A step's seconds are
rank 0's from a barrier to the end of its step: the step ends with the gradient all-reduce,
so the slowest replica sets it. Median of --steps after --warmup, per draw and layout; the
ratios to the uniform step close the run.

With --shares-alone one process (one GPU) trains each replica's share of the same layouts in
turn, without the others: the seconds each replica's work takes alone, so a layout's
imbalance in time (slowest share over the mean share) is seen apart from the long tail's own
cost (the mean share over the uniform layout's).

    python bench/balance_gpu.py --dp 2 --json $OUT/balance.json    # Qwen3-1.7B shape, 2 GPUs
    python bench/balance_gpu.py --dp 2 --shares-alone              # each replica's share, 1 GPU
    python bench/balance_gpu.py --dp 2 --shares-alone --draws 1 --profile $OUT/prof   # + profiles
    python bench/balance_gpu.py --cpu-dry-run                      # tiny sizes, gloo on CPU
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from balance_cpu import draw_lengths
from gpu_smoke_megatron import random_batch, smoke_recipe, spawn_ranks
from trainer_gpu import WORKLOADS, Shape, _near_policy, _profile_step, model_folder

from mtprun.compiler import compile_recipe
from mtprun.data.batch import PackedBatch
from mtprun.data.packing import bins
from mtprun.runner.run.steps import balance_step
from mtprun.spec import Recipe

QWEN3_1_7B = Shape("qwen3-1.7b", 2048, 28, 16, 8, 6144, 151936, "qwen3")
CPU_TINY = Shape("cpu-tiny-qwen3", 128, 2, 4, 2, 256, 256, "qwen3")
LAYOUTS = ("uniform", "unbalanced", "balanced")


def uniform_lengths(lengths: list[int]) -> list[int]:
    """As many sequences as `lengths`, of its mean length, the same tokens in all."""
    base, extra = divmod(sum(lengths), len(lengths))
    return [base + (1 if i < extra else 0) for i in range(len(lengths))]


def packed_in_order(lengths: list[int], budget: int, vocab: int, seed: int) -> list[PackedBatch]:
    """The sequences in order, packed into micro batches of at most `budget` tokens."""
    batches = []
    for j, (start, stop) in enumerate(bins(lengths, budget)):
        part = lengths[start:stop]
        batch = random_batch(vocab, sum(part), seed * 1000 + j, True, "cpu", part)
        batches.append(_near_policy(batch, vocab))
    return batches


def layouts(
    lengths: list[int], args: argparse.Namespace, recipe: Recipe, seed: int
) -> dict[str, tuple[list[PackedBatch], list[int], float]]:
    """Each layout's micro batches, the replica of each and its cost-model imbalance, as a
    GRPO step lays them out (`balance_step`) with trainer.balance on or off."""
    dp, budget, vocab = args.dp, args.micro_batch_tokens, args.shape.vocab

    def balance(on: bool) -> Recipe:
        return recipe.model_copy(
            update={"trainer": recipe.trainer.model_copy(update={"balance": on})}
        )

    out = {}
    for name, drawn, balanced in (
        ("uniform", uniform_lengths(lengths), True),
        ("unbalanced", lengths, False),
        ("balanced", lengths, True),
    ):
        batches = packed_in_order(drawn, budget, vocab, seed)
        batches, replica_of, metrics = balance_step(batches, balance(balanced), dp)
        replica_of = replica_of or [i % dp for i in range(len(batches))]  # round-robin
        out[name] = (batches, replica_of, metrics["train/dp_cost_imbalance"])
    return out


def time_share(trainer, share: list[PackedBatch], args: argparse.Namespace) -> list[float]:
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(share)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def _rank_process(rank: int, port: int, out: Path, folder: Path, args: argparse.Namespace):
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
    from mtprun.runner.trainer.trainer import Trainer
    from mtprun.spec.parallel import ParallelSection

    parallel = ParallelSection(dp=process_count(args))
    init_parallel(parallel, rank, parallel.world_size, "127.0.0.1", port)
    trainer_section = {"micro_batch_tokens": args.micro_batch_tokens, "recompute": args.recompute}
    recipe = smoke_recipe(
        folder, args.dtype, WORKLOADS["grpo"], True, trainer_section, {"dp": parallel.dp}
    )
    trainer = Trainer(recipe, folder, compile_recipe(recipe), args.device)
    rng = random.Random(args.seed)
    rows = []
    for draw in range(args.draws):
        lengths = draw_lengths(rng, args)
        for name, (batches, replica_of, cost_imbalance) in layouts(
            lengths, args, recipe, seed=draw
        ).items():
            shares = [rank] if not args.shares_alone else range(args.dp)
            owned = list(zip(batches, replica_of, strict=True))
            times = [time_share(trainer, [b for b, r in owned if r == i], args) for i in shares]
            steps = [statistics.median(t) for t in times]
            if args.profile and draw == 0:  # one more step of the first share, profiled
                first = [b for b, r in owned if r == shares[0]]
                path = args.profile / f"draw0-{name}-share{shares[0]}.json"
                _profile_step(partial(trainer.train_step, first), path)
            rows.append(
                {
                    "draw": draw,
                    "layout": name,
                    "step_s": round(max(steps), 4),
                    "timed_steps": [round(t, 4) for t in times[0]],
                    **({"share_s": [round(t, 4) for t in steps]} if args.shares_alone else {}),
                    "cost_imbalance": round(cost_imbalance, 4),
                    "sequences": len(lengths),
                    "longest": max(lengths),
                    "tokens": sum(lengths),
                    "micro_batches": len(batches),
                }
            )
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        out.write_text(json.dumps(rows))
    destroy_parallel()


def process_count(args: argparse.Namespace) -> int:
    """Trainer processes: one per replica, or one that trains every share in turn."""
    return 1 if args.shares_alone else args.dp


def summary(rows: list[dict]) -> dict[str, float]:
    """Per layout, the median over the draws of its step time over the uniform step's; with
    the shares timed alone also its slowest share over its mean share and its mean share over
    the uniform layout's."""
    by = {(r["draw"], r["layout"]): r for r in rows}
    draws = sorted({r["draw"] for r in rows})

    def ratio(name: str, value: Callable[[dict], float]) -> float:
        """The median over the draws of the layout's `value` over the uniform layout's."""
        return round(
            statistics.median(value(by[d, name]) / value(by[d, "uniform"]) for d in draws), 4
        )

    out = {f"{name}/uniform": ratio(name, step_seconds) for name in LAYOUTS[1:]}
    if "share_s" in rows[0]:
        for name in LAYOUTS:
            shares = [by[d, name]["share_s"] for d in draws]
            slowest = statistics.median(max(s) / statistics.fmean(s) for s in shares)
            out[f"{name} slowest/mean share"] = round(slowest, 4)
        for name in LAYOUTS[1:]:
            out[f"{name} mean share/uniform"] = ratio(name, mean_share)
    return out


def step_seconds(row: dict) -> float:
    return row["step_s"]


def mean_share(row: dict) -> float:
    return statistics.fmean(row["share_s"])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU, gloo")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tokens-per-rank", type=int, default=65536)
    parser.add_argument("--cap", type=int, default=16384)
    parser.add_argument("--median", type=float, default=2000.0)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    parser.add_argument("--draws", type=int, default=3, help="long-tailed steps drawn")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per draw and layout")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--shares-alone", action="store_true", help="one process trains each share in turn"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="one more step of each layout's first share of draw 0 under torch.profiler, "
        "summarized (bench/profile_step.py) into DIR/draw0-<layout>-share<i>.json",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, help="keep (and reuse) the model folder here")
    parser.add_argument("--json", type=Path, help="also write the rows and summary here")
    args = parser.parse_args()
    args.device = "cpu" if args.cpu_dry_run else "cuda"
    args.dtype = "float32" if args.cpu_dry_run else "bfloat16"
    args.shape = CPU_TINY if args.cpu_dry_run else QWEN3_1_7B
    if args.cpu_dry_run:
        args.tokens_per_rank, args.cap, args.median = 2048, 512, 64.0
        args.micro_batch_tokens, args.draws, args.steps = 512, 1, 1
    if args.micro_batch_tokens < args.cap:
        parser.error("--micro-batch-tokens must hold the longest sequence (--cap)")
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --cpu-dry-run to check the script on CPU")
        print(f"device: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_dir or Path(tmp)
        folder = model_folder(args.shape, args.cap, root, args.dtype, args.device)
        rows = spawn_ranks(
            _rank_process, process_count(args), (folder, args), args.device == "cuda"
        )
    result = {"summary": summary(rows), "rows": rows, **_settings(args)}
    print(json.dumps(result["summary"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def _settings(args: argparse.Namespace) -> dict:
    keep = ("dp", "tokens_per_rank", "cap", "median", "sigma", "micro_batch_tokens", "recompute")
    keep += ("shares_alone",)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"shape": args.shape.name, "device": device, **{k: getattr(args, k) for k in keep}}


if __name__ == "__main__":
    main()
