"""CPU benchmark: `time/sync_s` of the weight sync, Ray's object store against the
collective transfer (trainer rank 0 broadcasting bucketed bytes over gloo).

    PYTHONPATH=. .venv/bin/python bench/weight_sync_cpu.py --model tiny
    PYTHONPATH=. .venv/bin/python bench/weight_sync_cpu.py --model 0.5b
    PYTHONPATH=. .venv/bin/python bench/weight_sync_cpu.py --model 0.5b --lora 16

The real run path: a local Ray instance, one trainer rank (Megatron-core, the recipe's
`model.dtype`) and one vLLM rollout engine started from a random-init Qwen2 folder, and the
driver's `WeightSync.push()`. `tiny` is the quickstart's shape (hidden 128, 2 layers, char
vocab); `0.5b` is Qwen2-0.5B's (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocab
151936, tied: 494M parameters). Each method syncs `--repeats` times after one warm-up push
(the collective's first push also forms its group); the median and the fastest are printed
(on a shared machine the fastest is the one least disturbed by other processes).
`--lora RANK` trains adapters of that rank on every target (`model.lora`): the engine serves
the base with vLLM's LoRA layers and each push moves the adapters alone; `sync/bytes` is what
each engine received.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 256},
    "0.5b": {
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "vocab": 151936,
        "tie_embeddings": True,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layers", type=int, help="Decoder layers instead of the shape's.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora", type=int, metavar="RANK", help="Sync LoRA adapters of RANK.")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=["collective", "object_store"],
        default=["collective", "object_store"],
    )
    args = parser.parse_args()

    import ray
    from safetensors.torch import load_file

    from mtprun.compiler import compile_recipe
    from mtprun.data.tokenizer import build_tokenizer
    from mtprun.models import build_tiny_model
    from mtprun.runner.rollout.pool import RolloutPool
    from mtprun.runner.run.weight_sync import WeightSync
    from mtprun.runner.trainer.group import TrainerGroup
    from mtprun.spec import Recipe

    root = Path(tempfile.mkdtemp(prefix="ws", dir="/tmp"))  # Ray's sockets need a short path
    shape = {"architecture": "qwen2", "max_seq_len": 256, **SHAPES[args.model]}
    if args.layers:
        shape["layers"] = args.layers
    recipe = Recipe.model_validate(
        {
            "name": "weight-sync-bench",
            "model": {
                "tiny": shape,
                "dtype": args.dtype,
                "lora": {"rank": args.lora, "targets": ["all"]} if args.lora else None,
            },
            "task": {"name": "addition", "reward": "addition", "template": "char"},
            "losses": [{"kind": "grpo"}],
            "rollout": {"max_tokens": 6},
            "resources": {"num_cpus": 2},
        }
    )
    folder = build_tiny_model(recipe.model.tiny, build_tokenizer("char"), root / "model", seed=0)
    parameters = sum(t.numel() for t in load_file(folder / "model.safetensors").values())
    if args.dtype == "bfloat16":  # build_tiny_model writes float32; the engine reads config.json
        config = json.loads((folder / "config.json").read_text())
        config["dtype"] = "bfloat16"
        (folder / "config.json").write_text(json.dumps(config))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(root / "r"))
    results = {}
    try:
        trainer = TrainerGroup.start(recipe)
        trainer.build(recipe, str(folder), compile_recipe(recipe).to_json(), False)
        pool = RolloutPool.launch(recipe, folder, root / "engines").ready()
        for method in args.methods:
            sync = WeightSync(method, lambda: trainer, pool)
            pushes = [sync.push() for _ in range(args.repeats + 1)][1:]
            results[method] = {
                key: {
                    "median": statistics.median(p[key] for p in pushes),
                    "fastest": min(p[key] for p in pushes),
                }
                for key in ("time/sync_s", "time/engine_sync_s")
            }
            results[method]["sync/bytes"] = pushes[-1]["sync/bytes"]
        pool.shutdown()
        trainer.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "model": args.model,
                "layers": shape["layers"],
                "dtype": args.dtype,
                "lora_rank": args.lora,
                "parameters": parameters,
                "repeats": args.repeats,
                "date": time.strftime("%Y-%m-%d"),
                "device": f"CPU ({platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cores)",
                **results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
