"""CPU benchmark: rollout tokens/s with MTP speculative decoding against without it.

    .venv/bin/python bench/specdec_cpu.py --model runs/mtp-specdec/export/final

Same model folder (a MiMo checkpoint whose MTP head was trained, e.g. the export of
`mtprun recipes/mtp-specdec.yaml`), same prompts (the recipe's alphabet task), greedy
sampling through mtprun's RolloutEngine (vLLM in-process, float32, eager). Each
(speculation, batch size) runs in a fresh subprocess; after one warm-up generate, tokens/s
is the median over `--repeats` generates of the whole batch (the fastest in brackets: on a
shared machine it is the one least disturbed by other processes). With speculation the
draft acceptance of the timed generates is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "recipes" / "mtp-specdec" / "alphabet_prompts.jsonl"


def measure(model_dir: Path, speculative: bool, batch: int, repeats: int, max_tokens: int):
    """One configuration, in this process: {tokens_per_s, fastest, accept_rate}."""
    from transformers import AutoTokenizer

    from mtprun.data.render import Renderer
    from mtprun.data.tasks import get_task
    from mtprun.runner.rollout.engine import RolloutEngine, Sampling, spec_decode_metrics
    from mtprun.spec.rollout import RolloutSection

    renderer = Renderer(AutoTokenizer.from_pretrained(model_dir))
    prompts = get_task(str(PROMPTS)).prompts(batch, seed=0)
    token_ids = [
        renderer.render(p.messages, add_generation_prompt=True).token_ids.tolist() for p in prompts
    ]
    section = RolloutSection(
        temperature=0.0,
        max_tokens=max_tokens,
        speculative={"method": "mtp", "num_speculative_tokens": 1} if speculative else None,
    )
    with tempfile.TemporaryDirectory() as work:
        engine = RolloutEngine(model_dir, section, seed=0, work_dir=Path(work))
        try:
            sampling = Sampling(stop_token_ids=tuple(renderer.stop_token_ids))
            engine.generate(token_ids, n=1, sampling=sampling)  # warm-up
            before = engine.spec_decode_counters()
            rates = []
            for _ in range(repeats):
                start = time.perf_counter()
                samples = engine.generate(token_ids, n=1, sampling=sampling)
                seconds = time.perf_counter() - start
                rates.append(sum(len(s[0].token_ids) for s in samples) / seconds)
            after = engine.spec_decode_counters()
        finally:
            engine.shutdown()
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    accept = spec_decode_metrics(delta).get("rollout/spec_accept_rate")
    return {"tokens_per_s": statistics.median(rates), "fastest": max(rates), "accept": accept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "runs/mtp-specdec/export/final")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: "spec,batch" in a child
    args = parser.parse_args()
    if args.one:
        speculative, batch = args.one.split(",")
        result = measure(
            args.model.resolve(), speculative == "1", int(batch), args.repeats, args.max_tokens
        )
        print("RESULT " + json.dumps(result))
        return

    print(
        f"model {args.model}; {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores; greedy, max_tokens {args.max_tokens}, median of {args.repeats} [fastest]"
    )
    print("| batch | no speculation tok/s | MTP speculation tok/s | speed-up | acceptance |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        plain = _child(args, speculative=False, batch=batch)
        spec = _child(args, speculative=True, batch=batch)
        print(
            f"| {batch} | {plain['tokens_per_s']:.0f} [{plain['fastest']:.0f}] "
            f"| {spec['tokens_per_s']:.0f} [{spec['fastest']:.0f}] "
            f"| {spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x | {spec['accept']:.1%} |",
            flush=True,
        )


def _child(args: argparse.Namespace, speculative: bool, batch: int) -> dict:
    command = [
        sys.executable, __file__, "--one", f"{int(speculative)},{batch}", "--model",
        str(args.model), "--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


if __name__ == "__main__":
    main()
