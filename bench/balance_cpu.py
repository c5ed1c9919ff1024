"""CPU benchmark: data-parallel balancing of long-tailed RL steps under the cost model.

    .venv/bin/python bench/balance_cpu.py [--dp 2] [--tokens-per-rank 65536] [--steps 200]

Each step draws log-normal response lengths (median `--median`, sigma `--sigma`, capped at
`--cap`) until the step holds dp x tokens-per-rank tokens, then lays them out two ways: as
mtprun packed them before balancing (in rollout order into micro batches of at most `--cap`
tokens, dealt round-robin) and with `balanced_layout`. A replica's time is its cost,
sum of L (a + L) over its sequences (`mtprun.data.balance`, a of the Qwen3-1.7B shape); the
step waits for the slowest replica. Reported, mean and worst over the steps: the slowest
replica over a uniform-length step of the same tokens (every sequence of the step's mean
length, evenly split), the same for the bound no layout beats (the step's cost / dp), the
imbalance (slowest over mean), and the milliseconds `balanced_layout` takes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from mtprun.data.balance import balanced_layout, linear_length, sequence_cost
from mtprun.data.packing import bins
from mtprun.models.shape import ModelShape

QWEN3_1_7B = ModelShape(
    hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, vocab=151936
)


def draw_lengths(rng: random.Random, args: argparse.Namespace) -> list[int]:
    """One step's response lengths: log-normal (median, sigma), capped, until the step holds
    dp x tokens-per-rank tokens."""
    lengths: list[int] = []
    while sum(lengths) < args.dp * args.tokens_per_rank:
        drawn = rng.lognormvariate(math.log(args.median), args.sigma)
        lengths.append(max(1, min(args.cap, int(drawn))))
    return lengths


def step(rng: random.Random, args: argparse.Namespace, a: float) -> dict[str, float]:
    lengths = draw_lengths(rng, args)
    costs = [sequence_cost(n, a) for n in lengths]
    tokens = sum(lengths)
    uniform = tokens * (a + tokens / len(lengths)) / args.dp
    dealt = [0.0] * args.dp
    for i, (start, stop) in enumerate(bins(lengths, args.cap)):
        dealt[i % args.dp] += sum(costs[start:stop])
    tick = time.perf_counter()
    layout = balanced_layout(lengths, args.dp, args.cap, a)
    seconds = time.perf_counter() - tick
    mean = sum(costs) / args.dp
    return {
        "round_robin": max(dealt) / uniform,
        "balanced": max(layout.costs) / uniform,
        "bound": mean / uniform,
        "round_robin_imbalance": max(dealt) / mean,
        "balanced_imbalance": max(layout.costs) / mean,
        "layout_ms": seconds * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tokens-per-rank", type=int, default=65536)
    parser.add_argument("--cap", type=int, default=16384)
    parser.add_argument("--median", type=float, default=2000.0)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    a = linear_length(QWEN3_1_7B)
    rng = random.Random(args.seed)
    steps = [step(rng, args, a) for _ in range(args.steps)]
    report = {"a": round(a), **vars(args)}
    for name in steps[0]:
        values = [s[name] for s in steps]
        report[name] = {"mean": round(statistics.mean(values), 4), "worst": round(max(values), 4)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
