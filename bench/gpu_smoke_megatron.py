"""GPU smoke test of the trainer: Megatron-core GPTModel + mtprun's fused head loss.

Needs torch with CUDA, Triton, transformers and megatron-core (no vLLM, Ray or MLflow). For
each case it builds a random-init HF checkpoint, loads it into mtprun's `Trainer`
(bf16 weights, Megatron's DDP with float32 main gradients and its distributed optimizer, NCCL
process group of one), runs optimizer steps
on random packed batches and reports the head-loss metrics, step time and peak memory; then
it exports the weights to HF format, checks the trainer's log-probs against transformers, and
checks that a Trainer loaded from its state_dict takes the same next step. Last, on one GPU, a
recipe whose micro batch cannot fit the GPU must be refused (TrainerDoesNotFit) before the
trainer allocates anything.
The distill case also runs a frozen teacher of the same shape in every micro batch. With
`--pp N` the trainer is split into N pipeline stages, with `--cp N` every micro batch's tokens
over N context-parallel ranks; one process and GPU per rank (NCCL), and the last rank reports
(under cp the mimo case is skipped: mtp terms need cp 1).

    python bench/gpu_smoke_megatron.py                # on the GPU machine
    python bench/gpu_smoke_megatron.py --pp 2         # two pipeline stages on two GPUs
    python bench/gpu_smoke_megatron.py --cp 2         # two context-parallel ranks on two GPUs
    python bench/gpu_smoke_megatron.py --cpu-dry-run  # tiny sizes on CPU, checks the script
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from mtprun.compiler import compile_recipe
from mtprun.data.batch import PackedBatch
from mtprun.data.tokenizer import build_tokenizer
from mtprun.models.tiny import build_tiny_model
from mtprun.runner.trainer.fits import TrainerDoesNotFit
from mtprun.runner.trainer.trainer import Trainer
from mtprun.spec.model import TinyModel
from mtprun.spec.recipe import Recipe


@dataclass(frozen=True)
class Case:
    name: str
    architecture: str
    losses: list[dict]
    rl: bool = False


CASES = [
    Case("sft: ce + z_loss", "qwen2", [{"kind": "ce"}, {"kind": "z_loss"}]),
    Case(
        "grpo: grpo(k3 kl) + entropy",
        "qwen2",
        [{"kind": "grpo", "kl_coef": 0.05}, {"kind": "entropy", "coef": 0.001}],
        rl=True,
    ),
    Case("mimo: ce + mtp(soft)", "mimo", [{"kind": "ce"}, {"kind": "mtp"}]),
    # The teacher: a second random-init model of the same shape (run_case builds it).
    Case("distill: ce + distill(T=2)", "qwen2", [{"kind": "ce"}, {"kind": "distill"}]),
]
# (hidden, layers, heads, kv_heads, intermediate, vocab, tokens per micro batch, micro batches)
GPU_SIZE = (1024, 4, 8, 2, 4096, 32768, 4096, 2)
CPU_SIZE = (64, 2, 2, 2, 128, 128, 64, 2)


def random_lengths(tokens: int, low: int, high: int, g: torch.Generator) -> list[int]:
    """Lengths drawn uniformly in [low, high] until they fill `tokens` (the last one cut)."""
    lengths: list[int] = []
    while (left := tokens - sum(lengths)) > 0:
        lengths.append(min(int(torch.randint(low, high + 1, (1,), generator=g)), left))
    return lengths


def random_batch(
    vocab: int, tokens: int, seed: int, rl: bool, device: str, lengths: list[int] | None = None
) -> PackedBatch:
    """Sequences of 64..512 random tokens (or of the given `lengths`, which must sum to
    `tokens`) packed into `tokens`, 70% of targets trained."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = random_lengths(tokens, 64, 512, g)
    elif sum(lengths) != tokens:
        raise ValueError(f"lengths sum to {sum(lengths)}, not tokens={tokens}")
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.rand(tokens, generator=g) < 0.7
    mask[cu[1:].long() - 1] = False
    rl_fields = {}
    if rl:
        rl_fields = {
            "advantages": torch.randn(tokens, generator=g),
            "old_logprobs": -torch.rand(tokens, generator=g) * 3,
            "ref_logprobs": -torch.rand(tokens, generator=g) * 3,
        }
    positions = torch.cat([torch.arange(n) for n in lengths])
    batch = PackedBatch(ids, torch.roll(ids, -1), mask, positions, cu, **rl_fields)
    return batch.to(device)


def hf_logprob_gap(trainer: Trainer, batch: PackedBatch, folder: Path, device: str) -> float | None:
    """Max |trainer log-prob - transformers log-prob| over trained tokens, with the trainer's
    current weights exported to HF format (transformers in float32, trainer under autocast).
    Every pipeline stage must call it (both trainer calls are collective); None except on
    the last stage."""
    from transformers import AutoModelForCausalLM

    weights = trainer.hf_state_dict()
    logprobs = trainer.logprobs([batch])
    if not logprobs:
        return None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.to(device).eval()
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    with torch.no_grad():
        logits = torch.cat([model(s[None]).logits[0] for s in batch.input_ids.split(lengths)])
        want = logits.log_softmax(-1).gather(-1, batch.targets[:, None])[:, 0]
    got = logprobs[0].to(device)
    return round(float((got - want)[batch.loss_mask].abs().max()), 5)


def run_case(
    case: Case, size: tuple, device: str, dtype: str, steps: int, work: Path, layout: dict
) -> dict:
    hidden, layers, heads, kv_heads, inter, vocab, tokens, micro = size
    spec = TinyModel(
        architecture=case.architecture, hidden=hidden, layers=layers, heads=heads,
        kv_heads=kv_heads, intermediate=inter, vocab=vocab, max_seq_len=1024,
        mtp_layers=1 if case.architecture == "mimo" else 0,
    )  # fmt: skip
    folder = build_tiny_model(spec, build_tokenizer("char"), work / case.architecture, seed=0)
    losses = [_with_teacher(term, spec, work) for term in case.losses]
    recipe = smoke_recipe(folder, dtype, losses, case.rl, {"micro_batch_tokens": tokens}, layout)
    trainer = Trainer(recipe, folder, compile_recipe(recipe), device)
    batches = [random_batch(vocab, tokens, seed=i, rl=case.rl, device=device) for i in range(micro)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], {}
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        metrics = trainer.train_step(batches)
        sync()
        times.append(time.perf_counter() - start)
    result = {
        "case": case.name,
        "params_M": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "tokens_per_step": tokens * micro,
        "first_step_s": round(times[0], 3),
        "step_s": round(min(times[1:] or times), 4),
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device == "cuda"
        else None,
        "metrics": {k: round(v, 5) for k, v in metrics.items()},
        "hf_logprob_max_abs_diff": hf_logprob_gap(trainer, batches[0], folder, device),
        "resume_loss_diff": resume_loss_diff(trainer, recipe, folder, batches, device),
    }
    del trainer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def smoke_recipe(
    folder: Path, dtype: str, losses: list[dict], rl: bool, trainer: dict, layout: dict
) -> Recipe:
    """A recipe training the model in `folder` with `losses` on an arithmetic task (`rl`) or
    data source; AdamW at lr 1e-4 with grad_clip 1.0 unless `trainer` overrides them."""
    source = (
        {"task": {"name": "arithmetic", "reward": "arithmetic", "template": "char"}}
        if rl
        else {"data": {"source": "arithmetic", "template": "char"}}
    )
    return Recipe.model_validate(
        {
            "name": "gpu-smoke",
            "model": {"path": str(folder), "dtype": dtype},
            **source,
            "losses": losses,
            "trainer": {"lr": 1e-4, "grad_clip": 1.0, **trainer},
            "parallel": layout,
        }
    )


def resume_loss_diff(
    trainer: Trainer, recipe: Recipe, folder: Path, batches: list, device: str
) -> float:
    """|loss difference| of one more step between `trainer` and a new Trainer loaded from
    its state_dict (model, optimizer state, schedule): 0 when a checkpoint resumes exactly."""
    state = copy.deepcopy(trainer.state_dict())
    resumed = Trainer(recipe, folder, compile_recipe(recipe), device)
    resumed.load_state_dict(state)
    del state
    want = trainer.train_step(batches)
    got = resumed.train_step(batches)
    del resumed
    return abs(got["loss"] - want["loss"]) + abs(got["grad_norm"] - want["grad_norm"])


def _with_teacher(term: dict, spec: TinyModel, work: Path) -> dict:
    """A distill term gets a teacher folder (built once, seed 1) and temperature 2."""
    if term["kind"] != "distill":
        return term
    teacher = work / "teacher"
    if not teacher.exists():
        build_tiny_model(spec, build_tokenizer("char"), teacher, seed=1)
    return {**term, "teacher": str(teacher), "temperature": 2.0}


def run_cases(
    size: tuple, device: str, dtype: str, steps: int, layout: dict | None = None
) -> list[dict]:
    layout = layout or {}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            try:
                if layout.get("cp", 1) > 1 and case.architecture == "mimo":
                    continue
                results.append(run_case(case, size, device, dtype, steps, Path(tmp), layout))
            except Exception as error:  # report every case, even after one fails
                traceback.print_exc()
                results.append({"case": case.name, "error": f"{type(error).__name__}: {error}"})
            print(json.dumps(results[-1]), flush=True)
        if device == "cuda" and not layout:
            results.append(refused_past_memory(size, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    return results


def refused_past_memory(size: tuple, work: Path) -> dict:
    """A Trainer asked for 2^20-token micro batches on this GPU: refused before it allocates
    (the estimate's activations alone exceed an 80 GiB card)."""
    hidden, layers, heads, kv_heads, inter, vocab, _, _ = size
    spec = TinyModel(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=inter,
        vocab=vocab, max_seq_len=1024,
    )  # fmt: skip
    folder = build_tiny_model(spec, build_tokenizer("char"), work / "refused", seed=0)
    recipe = smoke_recipe(
        folder, "bfloat16", [{"kind": "ce"}], False, {"micro_batch_tokens": 2**20}, {}
    )
    before = torch.cuda.memory_allocated()
    result: dict[str, Any] = {"case": "refused: 2^20-token micro batches"}
    try:
        Trainer(recipe, folder, compile_recipe(recipe), "cuda")
        result["error"] = "not refused"
    except TrainerDoesNotFit as refused:
        result["refused"] = str(refused)
        result["allocated_MiB"] = round((torch.cuda.memory_allocated() - before) / 2**20, 1)
    return result


def _rank_process(rank: int, port: int, out: Path, layout: dict, steps: int) -> None:
    """Trainer rank `rank` of the `layout` on GPU `rank`; the last rank writes the results."""
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
    from mtprun.spec.parallel import ParallelSection

    parallel = ParallelSection(**layout)
    init_parallel(parallel, rank, parallel.world_size, "127.0.0.1", port)
    results = run_cases(GPU_SIZE, "cuda", "bfloat16", steps, layout)
    if rank == parallel.world_size - 1:
        out.write_text(json.dumps(results))
    destroy_parallel()


def run_spread(layout: dict, steps: int) -> list[dict]:
    """The cases on one process and GPU per rank of `layout` (pp, cp)."""
    return spawn_ranks(_rank_process, layout["pp"] * layout["cp"], (layout, steps))


def spawn_ranks(target: Callable[..., None], world: int, args: tuple, gpus: bool = True) -> Any:
    """Run `target(rank, port, out, *args)` in `world` spawned processes (one GPU each when
    `gpus`), `port` a free one for their process group; returns the JSON that one of them
    writes to the file `out`."""
    if gpus and torch.cuda.device_count() < world:
        found = torch.cuda.device_count()
        raise SystemExit(f"{world} ranks need {world} GPUs, this machine has {found}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        mp.start_processes(target, (port, out, *args), nprocs=world, start_method="spawn")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages, one GPU each")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks, one GPU each")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --cpu-dry-run to check the script on CPU")
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    import megatron.core

    print(f"megatron-core {megatron.core.__version__}")
    if args.pp * args.cp > 1:
        results = run_spread({"pp": args.pp, "cp": args.cp}, args.steps)
    elif args.cpu_dry_run:
        results = run_cases(CPU_SIZE, device, "float32", args.steps)
    else:
        results = run_cases(GPU_SIZE, device, "bfloat16", args.steps)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
