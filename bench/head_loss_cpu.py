"""CPU benchmark: fused head loss against the plain torch way, forward + backward.

    .venv/bin/python bench/head_loss_cpu.py [--repeats 5] [--fractions 1.0 0.5 0.03]

Loss: CE + z-loss + entropy bonus + GRPO with a k3 KL, N=4096 rows, H=512, V=32000, float32.
Fused runs with both schedules of the torch engine (one pass: logits computed once, 3
GEMMs; two passes: statistics then a recomputing gradient pass, 4 GEMMs).
"Plain torch" materialises the [N, V] logits and runs one softmax pass per term over every
row (the mask multiplies afterwards), as frameworks do today.

Each (method, active fraction) runs in a fresh subprocess. After one warm-up step the peak
RSS is reset; peak extra memory is the peak RSS of one forward + backward minus the RSS
before it (inputs and their .grad already allocated). Time is the median of `--repeats`
forward + backward steps (the fastest step in brackets: on a shared machine it is the one
least disturbed by other processes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from mtprun import HeadInputs, HeadPlan, head_loss
from mtprun.kernels import Chunking

N, H, V = 4096, 512, 32000
TERMS = [
    {"kind": "ce"},
    {"kind": "z_loss", "weight": 1e-4},
    {"kind": "entropy", "coef": 0.01},
    {"kind": "grpo", "kl_coef": 0.05, "kl_estimator": "k3"},
]


def make_inputs(fraction: float, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    active = torch.zeros(N, dtype=torch.bool)
    active[torch.randperm(N, generator=gen)[: round(fraction * N)]] = True
    return {
        "hidden": (torch.randn(N, H, generator=gen) * 0.05).requires_grad_(),
        "weight": (torch.randn(V, H, generator=gen) * 0.05).requires_grad_(),
        "targets": torch.randint(0, V, (N,), generator=gen),
        "loss_mask": active,
        "advantages": torch.randn(N, generator=gen),
        "old_logprobs": -torch.rand(N, generator=gen) * 10 - 5,
        "ref_logprobs": -torch.rand(N, generator=gen) * 10 - 5,
    }


def plain_torch(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unfused way: [N, V] logits, one softmax pass per term, mask applied afterwards."""
    logits = inputs["hidden"] @ inputs["weight"].T
    mask = inputs["loss_mask"].float()
    count = mask.sum().clamp(min=1)

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return (values * mask).sum() / count

    ce = token_mean(F.cross_entropy(logits, inputs["targets"], reduction="none"))
    z_loss = token_mean(torch.logsumexp(logits, dim=-1).square())
    logp_all = logits.log_softmax(dim=-1)
    entropy = token_mean(-(logp_all.exp() * logp_all).sum(-1))
    logp = logits.log_softmax(dim=-1).gather(1, inputs["targets"][:, None]).squeeze(1)
    adv = inputs["advantages"]
    ratio = torch.exp(logp - inputs["old_logprobs"])
    clipped = ratio.clamp(1 - 0.2, 1 + 0.28)
    delta = inputs["ref_logprobs"] - logp
    kl = torch.exp(delta) - delta - 1
    grpo = token_mean(-torch.minimum(ratio * adv, clipped * adv) + 0.05 * kl)
    return ce + 1e-4 * z_loss - 0.01 * entropy + grpo


# Both at the default 64 MiB budget. One pass: 174 rows x the whole vocab per chunk (logits
# computed once). Two passes (the default layout): 1024 rows x 5461-column tiles (statistics
# pass, then a gradient pass that recomputes the logits).
SCHEDULES = {"one-pass": Chunking(min_rows=128), "two-pass": Chunking()}


def fused(inputs: dict[str, torch.Tensor], plan: HeadPlan, chunking: Chunking) -> torch.Tensor:
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight")}
    checked = HeadInputs.build(plan, inputs["hidden"], inputs["weight"], **rest)
    return head_loss(checked, chunking=chunking).loss


def step(method: str, inputs: dict[str, torch.Tensor], plan: HeadPlan) -> None:
    loss = plain_torch(inputs) if method == "plain" else fused(inputs, plan, SCHEDULES[method])
    loss.backward()


def memory_status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: now, VmHWM: peak since the last reset)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(method: str, fraction: float, repeats: int) -> dict[str, float]:
    plan = HeadPlan.from_losses(TERMS)
    inputs = make_inputs(fraction)
    # Allocate the leaf gradients first so both methods count only their extra memory.
    inputs["hidden"].grad = torch.zeros_like(inputs["hidden"])
    inputs["weight"].grad = torch.zeros_like(inputs["weight"])  # steps accumulate into these
    step(method, inputs, plan)  # warm-up: code pages and thread pools are not the method's
    reset_peak_rss()
    baseline = memory_status("VmRSS")
    step(method, inputs, plan)
    peak = memory_status("VmHWM") - baseline
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(method, inputs, plan)
        times.append(time.perf_counter() - start)
    return {
        "time_s": statistics.median(times),
        "fastest_s": min(times),
        "peak_extra_mib": peak / 2**20,
    }


def run_worker(method: str, fraction: float, repeats: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--worker", method, str(fraction), str(repeats)]
    # Every allocation of 64 KiB or more is its own mapping, returned to the OS when freed,
    # so the resident set follows the live tensors (glibc would otherwise keep freed chunks).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.03])
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        method, fraction, repeats = args.worker
        print(json.dumps(worker(method, float(fraction), int(repeats))))
        return
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average before: {load}"
    )
    methods = ["plain", *SCHEDULES]
    header = [f"{m} time (s), median (fastest)" for m in methods]
    header += [f"time {m} / plain" for m in SCHEDULES]
    header += [f"{m} peak extra (MiB)" for m in methods]
    header += [f"memory {m} / plain" for m in SCHEDULES]
    print("| active | " + " | ".join(header) + " |")
    print("|---" * (len(header) + 1) + "|")
    for fraction in args.fractions:
        result = {m: run_worker(m, fraction, args.repeats) for m in methods}
        plain = result["plain"]
        cells = [f"{fraction:.0%}"]
        cells += [f"{result[m]['time_s']:.2f} ({result[m]['fastest_s']:.2f})" for m in methods]
        cells += [f"{result[m]['time_s'] / plain['time_s']:.3f}" for m in SCHEDULES]
        cells += [f"{result[m]['peak_extra_mib']:.0f}" for m in methods]
        cells += [
            f"1/{plain['peak_extra_mib'] / max(result[m]['peak_extra_mib'], 1e-9):.1f}"
            for m in SCHEDULES
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
