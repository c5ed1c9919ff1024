"""Where one trainer step's GPU time goes: torch.profiler over one `Trainer.train_step` of a
random-init model of Qwen2.5-1.5B's shape, kernels grouped by kind, top kernels listed, and
the GPU's idle gaps with the host op that was running in each (what the GPU waited for).
`summarize` and `sync_sites` (the step's host-device synchronizations by the mtprun, megatron
or fla frame that asked) also serve `bench/trainer_gpu.py --profile` for the other shapes.

    python bench/profile_step.py                              # 2048-token sequences
    python bench/profile_step.py --seq 8192 --recompute full --json $OUT/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mtprun.compiler import compile_recipe
from mtprun.data.batch import PackedBatch
from mtprun.data.tokenizer import build_tokenizer
from mtprun.models.tiny import build_tiny_model
from mtprun.runner.trainer.trainer import Trainer
from mtprun.spec.model import TinyModel
from mtprun.spec.recipe import Recipe

QWEN_1_5B = {
    "hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960,
    "vocab": 151936,
}  # fmt: skip
# Kernel name patterns, first match wins.
KINDS = [
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas"),
    ("attention", r"flex|flash|attention"),
    ("head loss (triton)", r"_stats|_grad|head|rows|select"),
    ("optimizer", r"adam|multi_tensor|foreach|_amp_"),
    ("communication", r"nccl"),
    ("copy / cast", r"copy|cast|convert|to_copy|memcpy|memset|fill"),
    ("elementwise / norm / other", r"."),
]


def equal_sequences(vocab: int, tokens: int, seq: int, seed: int) -> PackedBatch:
    """`tokens` random tokens as sequences of `seq` tokens, every target trained but each
    sequence's last."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    cu = torch.arange(0, tokens + 1, seq, dtype=torch.int32)
    mask = torch.ones(tokens, dtype=torch.bool)
    mask[cu[1:].long() - 1] = False
    positions = torch.arange(tokens) % seq
    return PackedBatch(ids, torch.roll(ids, -1), mask, positions, cu)


def mfu(params: int, hidden: int, layers: int, seq: int, tokens: int, step_s: float) -> float:
    """[6 (non-embedding params + H V) tokens + 6 L H s tokens] / step / 989 TFLOP/s."""
    flops = 6 * params * tokens + 6 * layers * hidden * seq * tokens
    return flops / step_s / 989e12


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE))


def idle_gaps(prof: profile, top: int) -> tuple[float, list[list]]:
    """Total GPU idle ms between the step's first and last kernel, and the `top` longest
    gaps: [ms, kernel before, kernel after, innermost host op open at the gap's middle]."""
    events = prof.events()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )
    if not kernels:
        return 0.0, []
    host = [e for e in events if e.device_type == DeviceType.CPU]
    gaps, (_, busy_until, last) = [], kernels[0]
    for start, end, name in kernels[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, busy_until, last, name))
        if end > busy_until:
            busy_until, last = end, name
    rows = []
    for length, begin, before, after in sorted(gaps, reverse=True)[:top]:
        middle = begin + length / 2
        open_ops = [e for e in host if e.time_range.start <= middle <= e.time_range.end]
        inner = min(open_ops, key=lambda e: e.time_range.elapsed_us(), default=None)
        rows.append(
            [round(length / 1e3, 2), before[:60], after[:60], inner.name[:60] if inner else "-"]
        )
    return round(sum(g[0] for g in gaps) / 1e3, 1), rows


def summarize(prof: profile, top: int) -> dict:
    """GPU-busy and idle ms of a profiled step, kernel ms by kind, the `top` kernels, idle
    gaps and host ops."""
    averages = prof.key_averages()  # one pass over the trace's events
    kernels = [
        e
        for e in averages
        if e.device_time_total > 0
        and e.device_type.name == "CUDA"
        and not getattr(e, "is_user_annotation", False)  # the optimizer's range, not a kernel
    ]
    idle_ms, gaps = idle_gaps(prof, top)
    total = sum(e.device_time_total for e in kernels)
    kinds: dict[str, float] = {}
    for e in kernels:
        kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + e.device_time_total
    return {
        "gpu_busy_ms": round(total / 1e3, 1),
        "gpu_idle_ms": idle_ms,
        "kinds_ms": {k: round(v / 1e3, 1) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
        "top": [
            [e.key[:90], round(e.device_time_total / 1e3, 2), e.count]
            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]
        ],
        "idle_gaps": gaps,
        "ops_top": [  # host ops by the GPU time of the kernels they (and their children) ran
            [e.key[:80], round(e.device_time_total / 1e3, 2), e.count]
            for e in sorted(
                (e for e in averages if e.device_type.name == "CPU"),
                key=lambda e: -e.device_time_total,
            )[:top]
        ],
        "host_top": [
            [e.key[:80], round(e.self_cpu_time_total / 1e3, 2), e.count]
            for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:top]
        ],
    }


def sync_sites(step: Callable[[], object], top: int) -> list[list]:
    """The host-device synchronizations of one `step` (torch's sync debug mode), counted by
    the innermost frame of mtprun, megatron or fla that asked for them: each empties the GPU's
    queue, which then idles while the host launches the next kernels."""
    sites: collections.Counter[str] = collections.Counter()
    ours = ("mtprun/", "megatron/", "fla/")

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return  # another warning of the step
        frames = [f for f in traceback.extract_stack()[:-1] if any(o in f.filename for o in ours)]
        if not frames:
            sites[f"{filename}:{lineno}"] += 1
            return
        frame = frames[-1]
        sites[f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [[where, count] for where, count in sites.most_common(top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--step-tokens", type=int, default=16384)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    spec = TinyModel(architecture="qwen2", max_seq_len=max(args.seq, 512), **QWEN_1_5B)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(spec, build_tokenizer("char"), Path(tmp) / "m", seed=0)
        recipe = Recipe.model_validate(
            {
                "name": "profile-step",
                "model": {"path": str(folder), "dtype": "bfloat16"},
                "data": {"source": "arithmetic", "template": "char"},
                "losses": [{"kind": "ce"}],
                "trainer": {
                    "lr": 1e-5,
                    "micro_batch_tokens": args.micro_batch_tokens,
                    "recompute": args.recompute,
                },
            }
        )
        trainer = Trainer(recipe, folder, compile_recipe(recipe), "cuda")
    micro = args.step_tokens // args.micro_batch_tokens
    batches = [
        equal_sequences(spec.vocab, args.micro_batch_tokens, args.seq, seed=i).to("cuda")
        for i in range(micro)
    ]
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(batches)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        trainer.train_step(batches)
        torch.cuda.synchronize()
    step = min(times[1:] or times)
    body = sum(p.numel() for n, p in trainer.model.named_parameters() if "embedding" not in n)
    result = {
        "seq": args.seq,
        "micro_batch_tokens": args.micro_batch_tokens,
        "recompute": args.recompute,
        "step_s": round(step, 4),
        "first_step_s": round(times[0], 2),
        "tokens_per_s": round(args.step_tokens / step),
        "mfu": round(mfu(body, spec.hidden, spec.layers, args.seq, args.step_tokens, step), 4),
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "loss": round(metrics["loss"], 4),
        **summarize(prof, args.top),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
