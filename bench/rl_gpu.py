"""The RL loop on GPUs (issue 34's bench): weight transfer into vLLM CUDA engines, and whole
`mtprun` GRPO runs with their per-step breakdown and tokens per second per GPU.

transfer: the HF-named bf16 weights of a shape (random, on the sender's GPU, as
`Trainer.hf_state_dict` hands them to a sync) into a vLLM CUDA engine serving that shape
(`load_format: dummy`: no checkpoint read), through mtprun's own paths, each in Ray actors:
- colocate: sender and engine on one GPU; `cuda_ipc.SharedWeights` packs the weights into
  1 GiB buckets, the engine maps them and reloads in place (`RolloutEngine.load_ipc_part`),
  awake and from sleep (level 2: its weights and KV cache released, woken by the sync);
- split: sender on GPU 0, engine on GPU 1; `weight_transfer.TransferGroup` broadcasts 256 MiB
  buckets over NCCL, the engine reloads them (`RolloutEngine.update_weights`).
Each is timed end to end on the sender's side (pack, handles or broadcast, the engine's reload,
release), the median of --repeat after one warm-up.

loop: a random-init model of the shape (written once in bf16 on the GPU) trained with GRPO by
`mtprun run` on a generated recipe: prompts of the built-in `arithmetic` task, --group samples
each, responses of exactly --max-tokens tokens (`rollout.ignore_eos`), colocated on one GPU or
split (trainer GPU 0, engine GPU 1; --staleness 1 for asynchronous rollouts). The run's MLflow
metrics are read back and the median over the steps after the first is printed: each part's
seconds (generation, log-probs, train, sync, the colocated handovers, idle) and
`throughput/tokens_per_s_per_gpu` (prompt + response tokens of the step over its wall time and
the run's GPUs), with `time/engine_generate_s` (inside vLLM's generate) beside the step's
generation and the engines' start-up facts from their Ray worker logs (KV cache size,
concurrency, captured graphs).

generate: the loop's generation alone, the "parts measured alone" a synchronous step is held
against: mtprun's `RolloutEngine` in this process (the loop's engine arguments, colocated ones
for --placement colocate), the same number of `arithmetic` prompts rendered by the same
template, --group samples of --max-tokens each; the median of --repeat generate calls after one
warm-up.

    python bench/rl_gpu.py transfer --shape qwen3-8b --placement colocate
    python bench/rl_gpu.py transfer --shape qwen3-8b --placement split      # two GPUs
    python bench/rl_gpu.py loop --shape qwen3-1.7b --placement colocate --steps 4
    python bench/rl_gpu.py loop --shape qwen3-1.7b --placement split --staleness 1
    python bench/rl_gpu.py loop --shape tiny --cpu-dry-run                  # CPU, minutes
    python bench/rl_gpu.py loop --shape qwen3-8b --placement colocate --lora-rank 64 \
        --recompute full --micro-batch-tokens 8192
    python bench/rl_gpu.py generate --shape qwen3-1.7b --placement colocate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie: bool

    def tiny(self, max_seq_len: int) -> dict[str, Any]:
        """The recipe's model.tiny section of this shape (a Qwen3 decoder)."""
        return {
            "architecture": "qwen3",
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
            "tie_embeddings": self.tie,
            "max_seq_len": max_seq_len,
        }


SHAPES = {
    "qwen3-8b": Shape(4096, 36, 32, 8, 12288, 151936, False),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 6144, 151936, True),
    "tiny": Shape(128, 2, 2, 1, 256, 256, False),  # CPU dry runs
}
STEP_PARTS = (
    "time/rollout_wait_s",
    "time/logprob_s",
    "time/train_s",
    "time/sync_s",
    "time/engine_sleep_s",
    "time/onload_s",
    "time/offload_s",
    "time/idle_s",
)


def model_folder(shape: Shape, root: Path, max_seq_len: int, weights: bool) -> Path:
    """The shape's HF folder (char tokenizer, Qwen3 config) under `root`; with `weights`
    random bf16 weights drawn on the GPU, else the config alone (for `load_format: dummy`)."""
    from mtprun.data.tokenizer import build_tokenizer
    from mtprun.models.tiny import build_tiny_model
    from mtprun.spec.model import TinyModel

    folder = root / f"{shape.hidden}x{shape.layers}-{'w' if weights else 'config'}"
    if (folder / "config.json").exists():
        return folder
    tiny = TinyModel(**shape.tiny(max_seq_len))
    tokenizer = build_tokenizer("char")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device if weights else "meta"):
            if weights:
                build_tiny_model(tiny, tokenizer, folder, seed=0)
            else:
                _config_only(tiny, tokenizer, folder)
    finally:
        torch.set_default_dtype(saved)
        if torch.cuda.is_available():
            # The loop's run starts after this in the same process: the weights drawn here
            # must not stay in this process's cache (31 GiB of an 8B shape's GPU held).
            torch.cuda.empty_cache()
    return folder


def _config_only(tiny: Any, tokenizer: Any, folder: Path) -> None:
    from mtprun.models.tiny import tiny_config

    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(tiny, tokenizer)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def hf_weights(folder: Path, device: str) -> dict[str, torch.Tensor]:
    """Random bf16 tensors under the HF names and shapes of the folder's model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    generator = torch.Generator(device).manual_seed(0)
    weights = {}
    for name, param in model.state_dict().items():
        tensor = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
        weights[name] = tensor.normal_(0, 0.02, generator=generator)
    return weights


# ---- transfer ------------------------------------------------------------------------------


class Sender:
    """The trainer side of a sync: HF weights on its GPU."""

    def __init__(self, folder: str) -> None:
        self.weights = hf_weights(Path(folder), "cuda")
        self.nbytes = sum(t.numel() * t.element_size() for t in self.weights.values())
        self.shared: Any = None
        self.host: Any = None

    def size(self) -> int:
        return self.nbytes

    def share(self) -> Any:
        from mtprun.runner.cuda_ipc import SharedWeights

        self.shared = SharedWeights(self.weights)
        return self.shared.handles

    def release(self) -> None:
        self.shared.release()
        self.shared = None

    def address(self) -> tuple[str, int]:
        import ray

        from mtprun.runner.net import free_port
        from mtprun.runner.weight_transfer import TransferHost

        self.host = TransferHost(ray.util.get_node_ip_address(), free_port())
        return self.host.address

    def form(self) -> None:
        self.host.form(1, 2)

    def send(self) -> int:
        return self.host.group.send(self.weights)


class Engine:
    """A vLLM CUDA engine serving the folder's shape with dummy weights."""

    def __init__(self, folder: str, colocate: bool, utilization: float) -> None:
        from mtprun.runner.rollout.engine import RolloutEngine
        from mtprun.spec.rollout import RolloutSection

        rollout = RolloutSection(gpu_memory_utilization=utilization, max_tokens=16)
        work = Path(folder).parent / "engine"
        self.engine = RolloutEngine(
            Path(folder), rollout, 0, work, colocate=colocate,
            engine_args={"load_format": "dummy"},
        )  # fmt: skip
        self.transfer: Any = None

    def sleep(self) -> float:
        return self.engine.sleep()

    def load_ipc(self, handles: Any) -> float:
        """The sender's weights as one part (the raw IPC path; a run streams a few layers a
        part, `RolloutEngine.load_ipc_part`)."""
        self.engine.begin_update(1)
        self.engine.load_ipc_part(handles)
        return self.engine.finish_update()

    def join(self, host: str, port: int) -> None:
        from mtprun.runner.weight_transfer import TransferGroup

        self.transfer = TransferGroup.join(host, port, 1, 1, 2)

    def receive(self) -> float:
        return self.engine.update_weights(self.transfer.receive(), 1)

    def greedy(self) -> list[int]:
        from mtprun.runner.rollout.engine import Sampling

        (samples,) = self.engine.generate([[5, 6, 7]], 1, Sampling(temperature=0.0))
        return samples[0].token_ids


def run_transfer(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    shape = SHAPES[args.shape]
    folder = model_folder(shape, Path(args.work), 4096, weights=False)
    colocate = args.placement == "colocate"
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False)
    share = 0.5 if colocate else 1
    engine = ray.remote(num_gpus=share)(Engine).remote(str(folder), colocate, args.utilization)
    ray.get(engine.greedy.remote())  # up, graphs captured
    sender = ray.remote(num_gpus=share)(Sender).remote(str(folder))
    nbytes = ray.get(sender.size.remote())
    rows: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> None:
        start = time.perf_counter()
        engine_s = fn()
        rows.setdefault(name, []).append(time.perf_counter() - start)
        rows.setdefault(f"{name}/engine_reload", []).append(engine_s)

    for _ in range(args.repeat + 1):
        if colocate:
            timed("awake", lambda: _ipc_once(sender, engine))
            ray.get(engine.sleep.remote())
            timed("from_sleep", lambda: _ipc_once(sender, engine))
        else:
            timed("nccl", lambda: _nccl_once(sender, engine))
    ray.get(engine.greedy.remote())  # the engine still generates after the loads
    result = {
        "shape": args.shape,
        "placement": args.placement,
        "gib": nbytes / 2**30,
        "device": torch.cuda.get_device_name(0),
        **{name: statistics.median(times[1:]) for name, times in rows.items()},
    }
    print(json.dumps(result), flush=True)
    ray.shutdown()
    return result


def _ipc_once(sender: Any, engine: Any) -> float:
    import ray

    handles = ray.get(sender.share.remote())
    engine_s = ray.get(engine.load_ipc.remote(handles))
    ray.get(sender.release.remote())
    return engine_s


_FORMED: set[int] = set()


def _nccl_once(sender: Any, engine: Any) -> float:
    import ray

    if id(sender) not in _FORMED:  # the group forms once, as a run's does
        host, port = ray.get(sender.address.remote())
        joined = engine.join.remote(host, port)
        ray.get(sender.form.remote())
        ray.get(joined)
        _FORMED.add(id(sender))
    received = engine.receive.remote()
    ray.get(sender.send.remote())
    return ray.get(received)


# ---- loop ----------------------------------------------------------------------------------


def loop_recipe(args: argparse.Namespace, folder: Path | None) -> dict[str, Any]:
    shape = SHAPES[args.shape]
    gpu = not args.cpu_dry_run
    colocate = args.placement == "colocate"
    gpus = 1 if colocate else 2
    model: dict[str, Any] = {"path": str(folder)} if folder else {"tiny": shape.tiny(4096)}
    if args.lora_rank:
        model["lora"] = {"rank": args.lora_rank}
    return {
        "name": f"rl-gpu-{args.shape}-{args.placement}-k{args.staleness}-r{args.lora_rank}",
        "run_dir": str(
            Path(args.work)
            / "runs"
            / f"{args.shape}-{args.placement}-{args.staleness}-r{args.lora_rank}"
        ),
        "seed": 0,
        "model": {**model, "dtype": "bfloat16" if gpu else "float32"},
        "task": {
            "name": "arithmetic",
            "reward": "arithmetic",
            "template": "char",
            "samples_per_prompt": args.group,
            "prompts_per_step": args.prompts,
        },
        "losses": [{"kind": "grpo", "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0}],
        "rollout": {
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "max_staleness": args.staleness,
        },
        "trainer": {
            "lr": 1e-6,
            "steps": args.steps,
            "micro_batch_tokens": args.micro_batch_tokens,
            "recompute": args.recompute,
            "checkpoint_every": 1000,  # none inside the measured steps
        },
        "resources": {
            "num_gpus": gpus if gpu else 0,
            "gpus_per_actor": 1 if gpu else 0,
            "placement": args.placement if gpu else "split",
        },
        "tracking": {"experiment": "rl_gpu"},
    }


def run_loop(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    folder = None
    if not args.cpu_dry_run:
        start = time.perf_counter()
        folder = model_folder(SHAPES[args.shape], work / "models", 4096, weights=True)
        print(f"model folder {folder} ({time.perf_counter() - start:.0f} s)", flush=True)
    recipe = loop_recipe(args, folder)
    path = work / f"{recipe['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=1))  # JSON is YAML
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code = "import sys; from mtprun.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", code, "run", str(path)]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"mtprun run failed ({done.returncode}): {' '.join(command)}")
    metrics = read_metrics(Path(recipe["run_dir"]))
    result = summarize(metrics, args, wall)
    result["engine_log"] = engine_log_lines(Path(recipe["run_dir"]))
    print(json.dumps(result), flush=True)
    return result


def run_generate(args: argparse.Namespace) -> dict[str, Any]:
    from mtprun.runner.rollout.engine import RolloutEngine
    from mtprun.spec import Recipe

    work = Path(args.work)
    if args.cpu_dry_run:
        from mtprun.data.tokenizer import build_tokenizer
        from mtprun.models.tiny import build_tiny_model

        recipe = Recipe.model_validate(loop_recipe(args, None))
        tokenizer = build_tokenizer(recipe.task.template)
        folder = build_tiny_model(recipe.model.tiny, tokenizer, work / "models" / "tiny", 0)
    else:
        folder = model_folder(SHAPES[args.shape], work / "models", 4096, weights=True)
    recipe = Recipe.model_validate(loop_recipe(args, folder))
    prompts = _loop_prompts(recipe, folder)
    start = time.perf_counter()
    engine = RolloutEngine(
        folder,
        recipe.rollout,
        recipe.seed,
        work / "generate",
        colocate=args.placement == "colocate",
        dtype=recipe.model.dtype,
    )
    started = time.perf_counter() - start
    seconds, tokens = [], 0
    for _ in range(args.repeat + 1):  # the first captures graphs and warms caches
        start = time.perf_counter()
        groups = engine.generate(prompts, n=args.group)
        seconds.append(time.perf_counter() - start)
        pairs = zip(prompts, groups, strict=True)
        tokens = sum(len(p) + len(s.token_ids) for p, group in pairs for s in group)
    generate_s = statistics.median(seconds[1:])
    result = {
        "mode": "generate",
        "shape": args.shape,
        "placement": args.placement,
        "requests": len(prompts) * args.group,
        "engine_start_s": started,
        "generate_s": generate_s,
        "all_generate_s": seconds,
        "tokens_per_s": tokens / generate_s,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    print(json.dumps(result), flush=True)
    return result


def _loop_prompts(recipe: Any, folder: Path) -> list[list[int]]:
    """The first step's prompts, rendered as the loop renders them."""
    from mtprun.data.render import folder_renderer
    from mtprun.data.tasks import get_task

    renderer = folder_renderer(folder, recipe.task.renderer)
    task = get_task(recipe.task.name)
    prompts = task.step_prompts(recipe.task.prompts_per_step, recipe.seed, 1)
    return [
        renderer.render(p.messages, add_generation_prompt=True).token_ids.tolist() for p in prompts
    ]


# vLLM's start-up facts that explain a slow generation: its KV cache (a cache smaller than the
# step's sequences runs them in waves), the concurrency it allows, the graphs it captured.
_ENGINE_FACTS = ("KV cache", "concurrency", "Graph capturing", "init engine", "CUDA graph")


def engine_log_lines(run_root: Path) -> list[str]:
    """The engines' start-up facts from the run's Ray worker logs (vLLM logs to the worker's
    stdout, which the run does not echo)."""
    from mtprun.runner.run_dir import RunDir

    logs = RunDir(run_root).ray_temp_dir() / "session_latest" / "logs"
    lines = []
    for path in sorted(logs.glob("worker-*.out")) + sorted(logs.glob("worker-*.err")):
        text = path.read_text(errors="replace")
        lines += [
            line.strip()[-200:]
            for line in text.splitlines()
            if any(f in line for f in _ENGINE_FACTS)
        ]
    return lines


def read_metrics(run_root: Path) -> dict[str, dict[int, float]]:
    """Every metric of the run's MLflow run, by step (its local sqlite store)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_root / 'mlflow.db'}")
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id, max_results=1)
    return {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in run.data.metrics
    }


def summarize(metrics: dict[str, dict[int, float]], args: argparse.Namespace, wall: float) -> dict:
    """Medians over the steps after the first (its rollout captures graphs, warms caches)."""
    steps = sorted(metrics["time/step_s"])
    measured = steps[1:] or steps

    def median(key: str) -> float | None:
        values = [metrics[key][s] for s in measured if s in metrics.get(key, {})]
        return statistics.median(values) if values else None

    keys = ("time/step_s", "time/rollout_s", "time/engine_generate_s", *STEP_PARTS)
    keys += ("time/engine_sync_s", "rollout/engine_tokens_per_s")
    keys += ("throughput/tokens_per_s", "throughput/tokens_per_s_per_gpu", "response/length")
    out = {
        "shape": args.shape,
        "placement": args.placement,
        "staleness": args.staleness,
        "lora_rank": args.lora_rank,
        "steps": len(steps),
        "run_wall_s": wall,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    out.update({key: median(key) for key in keys})
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("transfer", "loop", "generate"))
    parser.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--placement", choices=("colocate", "split"), default="colocate")
    parser.add_argument("--work", default="/tmp/rl_gpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--utilization", type=float, default=0.3, help="transfer: the engine's")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--lora-rank", type=int, default=0, help="loop: train LoRA adapters")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    parser.add_argument("--cpu-dry-run", action="store_true", help="loop: a tiny model on CPU")
    parser.add_argument("--json", help="append the result as a JSON line to this file")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.cpu_dry_run:
        args.shape, args.max_tokens, args.prompts, args.group = "tiny", 8, 4, 2
        args.micro_batch_tokens = 512
    run = {"transfer": run_transfer, "loop": run_loop, "generate": run_generate}[args.mode]
    result = run(args)
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
