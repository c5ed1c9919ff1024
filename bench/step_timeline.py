"""Where one head-loss step waits: each GPU kernel with the host time it was launched at.

    python bench/step_timeline.py --workload sft --active 0.03

Runs the bench's mtprun step (forward + backward, the shapes of bench/head_loss_gpu.py) and
prints, without a profiler, the host time and the GPU time (a CUDA event) at the entry and
exit of the head loss's phases: where the GPU time is close to the host time, the GPU had
caught up and waited for the host. With --profile, also a torch.profiler timeline: per
kernel, when the host launched it, when the GPU started it, how long it ran, the GPU idle
time before it and the Python line that launched it (the profiler slows the host ~3x).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent))

from head_loss_gpu import make_inputs, mtprun_step

import mtprun.kernels.triton as triton_package
from mtprun.kernels import HeadInputs
from mtprun.kernels.triton import engine, groups, head_loss, select

# (module, function name) pairs whose entry and exit are marked
MARKED = [
    (HeadInputs, "build"),
    (triton_package, "triton_head_loss"),
    (head_loss, "_kernel_groups"),
    (head_loss, "select_policy_rows"),
    (select, "check_values"),
    (select, "policy_group"),
    (groups, "build"),
    (groups, "kernel_terms"),
    (head_loss, "run_chunks"),
    (engine, "chunk_rows"),
    (engine, "run_rows"),
    (head_loss, "_metrics"),
    (head_loss, "_logprobs"),
    (head_loss, "_scatter_rows"),
    (head_loss, "scale_"),
]
# With --calls, also every call of these (the CUDA calls the prologue is made of).
CALLS = [
    (torch, "mm"),
    (torch, "empty"),
    (torch, "empty_like"),
    (torch.Tensor, "cpu"),
    (torch.Tensor, "new_empty"),
    (torch.Tensor, "index_select"),
    (JITFunction, "run"),
]


class Marks:
    """Host time, and with `events` a CUDA event, at the entry and exit of the MARKED
    functions (without events a mark costs ~1 us of host time, with them ~10 us)."""

    def __init__(self, events: bool, calls: bool) -> None:
        self.events = events
        self.points: list[tuple[str, float, torch.cuda.Event | None]] = []
        for module, name in MARKED + (CALLS if calls else []):
            setattr(module, name, self._wrap(name, getattr(module, name)))

    def mark(self, label: str) -> None:
        event = None
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.points.append((label, time.perf_counter(), event))

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            self.mark(f"> {name}")
            out = fn(*args, **kwargs)
            self.mark(f"< {name}")
            return out

        return wrapped

    def run(self, step) -> list[tuple[str, float, float]]:
        """(label, host us, GPU us or nan) per point of one step."""
        torch.cuda.synchronize()
        self.points.clear()
        self.mark("step")
        step()
        self.mark("end")
        torch.cuda.synchronize()
        _, host0, event0 = self.points[0]
        return [
            (
                label,
                (host - host0) * 1e6,
                event0.elapsed_time(event) * 1e3 if event is not None else float("nan"),
            )
            for label, host, event in self.points
        ]

    def report(self, step, reps: int) -> None:
        """Medians over `reps` steps of each point's host and GPU time."""
        runs = [self.run(step) for _ in range(reps)]
        print(f"{'host us':>8} {'GPU us':>8} {'ahead':>6}  point")
        for i, (label, _, _) in enumerate(runs[0]):
            host = statistics.median(r[i][1] for r in runs)
            gpu = statistics.median(r[i][2] for r in runs)
            print(f"{host:8.0f} {gpu:8.0f} {gpu - host:6.0f}  {label}")


def host_and_wall_us(step, reps: int) -> tuple[float, float]:
    """Medians of the host time of `step` (until it returns) and its CUDA-event time."""
    hosts, walls = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        hosts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end) * 1e3)
    return statistics.median(hosts), statistics.median(walls)


def trace_events(step) -> list[dict]:
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        with_stack=True,
    ) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def _caller(frames: list[dict], ts: float) -> str:
    """The innermost mtprun Python frame around host time `ts`."""
    around = [
        f
        for f in frames
        if f["ts"] <= ts <= f["ts"] + f.get("dur", 0)
        and ("mtprun/" in f["name"] or "bench/" in f["name"])
    ]
    best = max(around, key=lambda f: f["ts"], default=None)
    if best is None:
        return "?"
    name = best["name"]
    return name[name.find("mtprun/") :] if "mtprun/" in name else name[-60:]


def print_timeline(events: list[dict]) -> None:
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    frames = [e for e in events if e.get("cat") == "python_function"]
    origin = min(e["ts"] for e in frames)
    print(f"{'launch':>8} {'start':>8} {'dur':>7} {'idle':>6}  kernel / launched from")
    busy, previous_end = 0.0, None
    for kernel in kernels:
        launch = launches.get(kernel["args"].get("correlation"))
        launch_ts = launch["ts"] if launch else float("nan")
        idle = 0.0 if previous_end is None else max(0.0, kernel["ts"] - previous_end)
        previous_end = max(previous_end or 0.0, kernel["ts"] + kernel["dur"])
        busy += kernel["dur"]
        print(
            f"{launch_ts - origin:8.0f} {kernel['ts'] - origin:8.0f} {kernel['dur']:7.0f} "
            f"{idle:6.0f}  {kernel['name'][:50]}  <- {_caller(frames, launch_ts)}"
        )
    first = kernels[0]["ts"]
    print(f"GPU busy {busy:.0f} us over {previous_end - first:.0f} us from the first kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="sft")
    parser.add_argument("--active", type=float, default=0.03)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--calls", action="store_true", help="also mark torch.mm, allocations, reads, launches"
    )
    args = parser.parse_args()
    inputs = make_inputs(args.workload, args.active, args.n, args.h, args.v, seed=0)
    step = mtprun_step(args.workload, inputs, chunk_bytes=None)
    for _ in range(5):
        step()
    host, wall = host_and_wall_us(step, args.reps)
    print(f"{args.workload} {args.active:.0%}: host {host:.0f} us, CUDA events {wall:.0f} us")
    marks = Marks(events=False, calls=args.calls)
    for events in (False, True):
        print("marks with CUDA events:" if events else "host-only marks:")
        marks.events = events
        marks.report(step, reps=20)
    if args.profile:
        print_timeline(trace_events(step))


if __name__ == "__main__":
    main()
