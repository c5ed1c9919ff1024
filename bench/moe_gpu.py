"""A mixture-of-experts training step on the GPU (issue 24's benches (b) and (c)): mtprun's
trainer (megatron-core MoE layer, grouped-GEMM experts) against transformers' Qwen3-MoE with
`experts_implementation="grouped_mm"`, on a random-init model of Qwen3-30B-A3B's shape
(hidden 2048, 32 / 4 heads of 128, 128 experts of width 768, top 8, vocab 151936) with its
layers cut to `--layers`.

Each trainer takes the same step of `--step-tokens` tokens (sequences of `--seq`) per GPU as
one micro batch: bf16 weights, AdamW, grad clip 1.0, cross-entropy on 70% of the tokens.
mtprun as in `trainer_gpu.py` (float32 main gradients, distributed optimizer); transformers
with SDPA, its grouped-GEMM experts, a float32 full-logit loss and torch's fused AdamW on the
bf16 weights. With `--ep N` only mtprun runs, on N GPUs as dp=N, ep=N (each rank its own
tokens and 128/N experts); the last rank reports. Median of the timed steps after the
warm-up ones; each row printed as a JSON line.

MFU counts the parameters a token uses: [6 (active non-embedding params + H V) tokens +
6 L Q s tokens] / step / (peak x GPUs), active = attention + norms + router + top_k experts
per layer; Q = heads x head_dim (4096), s the sequence length.

    python bench/moe_gpu.py                                   # (b): 4 layers, one H100
    python bench/moe_gpu.py --layers 8 --ep 2 --trainers mtprun   # (c): two GPUs
    python bench/moe_gpu.py --cpu-dry-run                     # tiny sizes on CPU

A random-init router loads the ep ranks unevenly (run 93: the busiest rank 1.02-1.25x the mean
by layer), and the others wait for it; `--balanced-routing` routes mtprun's rows on random
logits instead, as megatron-core's own MoE benchmarks do, to measure the exchange without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_smoke_megatron import random_batch, smoke_recipe, spawn_ranks
from trainer_gpu import GRAD_CLIP, LR, _free_memory, _peak_gib, time_steps

from mtprun.compiler import compile_recipe
from mtprun.data.tokenizer import build_tokenizer

PEAK_TFLOPS = 989.0  # H100 SXM, dense bf16


@dataclass(frozen=True)
class MoEShape:
    hidden: int = 2048
    layers: int = 4
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    expert_ffn: int = 768
    vocab: int = 151936

    def active_params(self) -> int:
        """Non-embedding parameters one token runs through (its top_k experts)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + 2 * self.head_dim
        moe = h * self.experts + self.top_k * 3 * h * self.expert_ffn
        return self.layers * (attention + moe + 2 * h) + h

    def step_flops(self, lengths: list[int]) -> float:
        q = self.heads * self.head_dim
        dense = 6 * (self.active_params() + self.hidden * self.vocab) * sum(lengths)
        return dense + 6 * self.layers * q * sum(n * n for n in lengths)


CPU_SHAPE = MoEShape(hidden=64, layers=2, heads=2, kv_heads=2, head_dim=32, experts=4,
                     top_k=2, expert_ffn=32, vocab=256)  # fmt: skip


def model_folder(shape: MoEShape, max_seq: int, root: Path, device: str) -> Path:
    """A random-init Qwen3-MoE folder of `shape` (bf16 on a GPU), with a tokenizer; one that
    `root` already holds is reused (8 layers take minutes to build and write)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    folder = root / f"qwen3-moe-{shape.layers}l-{str(dtype).removeprefix('torch.')}"
    if (folder / "config.json").exists():
        return folder

    config = Qwen3MoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=6144,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.expert_ffn, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=max(max_seq, 4096), rope_theta=1e6,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    build_tokenizer("chatml").save_pretrained(folder)
    return folder


def run_mtprun(
    folder: Path, batch, args: argparse.Namespace, layout: dict
) -> tuple[list[float], dict]:
    """The timed steps' seconds, and under ep > 1 the last step's expert-parallel load."""
    from mtprun.runner.trainer import experts
    from mtprun.runner.trainer.trainer import Trainer

    if args.dispatcher == "megatron":  # the side-by-side row: megatron-core's own exchange
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        experts.RankDedupDispatcher = MoEAlltoAllTokenDispatcher

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    trainer_section = {
        "micro_batch_tokens": args.step_tokens,
        "recompute": args.recompute,
        "optimizer_state": args.optimizer_state,
    }
    recipe = smoke_recipe(folder, dtype, [{"kind": "ce"}], False, trainer_section, layout)
    trainer = Trainer(recipe, folder, compile_recipe(recipe), args.device)
    if args.balanced_routing:
        _route_at_random(trainer.model)
    last: dict = {}

    def step() -> torch.Tensor:
        last.update(trainer.train_step([batch]))
        return last["loss"]

    times, _ = time_steps(step, args.warmup, args.steps, args.device)
    # The trainer's own measure of what the ep ranks wait for (routing.py), last step.
    extra = {k: round(v, 4) for k, v in last.items() if k == "moe/ep_load_max_over_mean"}
    if args.profile:
        print(json.dumps(profile_one_step(lambda: trainer.train_step([batch]), args.top)))
    return times, extra


def _route_at_random(model: torch.nn.Module) -> None:
    """megatron-core's benchmark routing (`moe_router_force_load_balancing`): every router's
    logits replaced by random normal ones (a seed per expert-parallel rank), so each expert
    gets about T k / E of the pairs whatever the router's weights."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.config.moe_router_force_load_balancing = True


def profile_one_step(step, top: int) -> dict:
    """GPU ms of one step by kernel kind, the top kernels and the longest idle gaps
    (`profile_step.py`'s grouping)."""
    from profile_step import idle_gaps, kind_of
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_time_total > 0
        and e.device_type.name == "CUDA"
        and not getattr(e, "is_user_annotation", False)
    ]
    kinds: dict[str, float] = {}
    for e in kernels:
        kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + e.device_time_total / 1e3
    idle_ms, gaps = idle_gaps(prof, top)
    return {
        "gpu_busy_ms": round(sum(kinds.values()), 1),
        "gpu_idle_ms": idle_ms,
        "kinds_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
        "top": [
            [e.key[:80], round(e.device_time_total / 1e3, 2), e.count]
            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]
        ],
        "idle_gaps": gaps,
    }


def run_hf(folder: Path, batch, args: argparse.Namespace) -> tuple[list[float], dict]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    implementation = args.hf_experts if args.device == "cuda" else "eager"
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="sdpa", experts_implementation=implementation
    ).to(args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=args.device == "cuda")
    rows = batch.input_ids.numel() // args.seq
    ids = batch.input_ids.view(rows, args.seq)
    targets = torch.where(batch.loss_mask, batch.targets, -100).view(rows, args.seq)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        return loss.detach()

    times, _ = time_steps(step, args.warmup, args.steps, args.device)
    return times, {}


def measure(trainer: str, folder: Path, shape: MoEShape, args, layout: dict) -> dict:
    _free_memory(args.device)
    lengths = [args.seq] * (args.step_tokens // args.seq)
    batch = random_batch(shape.vocab, args.step_tokens, 0, False, args.device, lengths)
    row = {"trainer": trainer, "layers": shape.layers, "ep": layout.get("ep", 1),
           "tokens_per_gpu": args.step_tokens}  # fmt: skip
    if trainer == "mtprun":
        row["optimizer_state"] = args.optimizer_state
        row["dispatcher"] = args.dispatcher
        row["routing"] = "random logits" if args.balanced_routing else "router"
    try:
        times, extra = (
            run_mtprun(folder, batch, args, layout)
            if trainer == "mtprun"
            else run_hf(folder, batch, args)
        )
    except torch.OutOfMemoryError:
        return {**row, "result": "OOM", "peak_gib": _peak_gib(args.device)}
    except Exception as err:  # a failing row is reported and the run goes on
        traceback.print_exc()
        return {**row, "result": f"error: {err}"}
    step = statistics.median(times)
    gpus = layout.get("dp", 1)
    mfu = shape.step_flops(lengths) * gpus / step / (PEAK_TFLOPS * 1e12 * gpus)
    return {
        **row,
        "step_ms": round(step * 1e3, 1),
        "tok_per_s_per_gpu": round(args.step_tokens / step),
        "mfu_active": round(mfu, 4),
        "peak_gib": _peak_gib(args.device),
        "times_s": [round(t, 4) for t in times],
        **extra,
    }


def _rank_process(rank, port, out, folder, shape, args, layout) -> None:
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
    from mtprun.spec.parallel import ParallelSection

    parallel = ParallelSection(**layout)
    init_parallel(parallel, rank, parallel.world_size, "127.0.0.1", port)
    row = measure("mtprun", folder, shape, args, layout)
    if rank == parallel.world_size - 1:
        out.write_text(json.dumps([row]))
    destroy_parallel()


def _runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(trainer, dispatcher) of each row: mtprun once per dispatcher; with ep > 1 only mtprun."""
    runs = []
    for trainer in args.trainers.split(","):
        dispatchers = args.dispatchers.split(",") if trainer == "mtprun" else ["-"]
        runs += [(trainer, dispatcher) for dispatcher in dispatchers]
    return [run for run in runs if args.ep == 1 or run[0] == "mtprun"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--step-tokens", type=int, default=16384, help="tokens per GPU a step")
    parser.add_argument("--trainers", default="mtprun,hf")
    parser.add_argument(
        "--hf-experts", default="grouped_mm", help="transformers' experts_implementation"
    )
    parser.add_argument("--ep", type=int, default=1, help="GPUs as dp=ep=N (mtprun only)")
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument(
        "--optimizer-state", default="float32", choices=("float32", "bfloat16"),
        help="mtprun's AdamW moments (trainer.optimizer_state)",
    )  # fmt: skip
    parser.add_argument(
        "--dispatchers", default="dedup",
        help="mtprun's token exchange, comma-separated for side-by-side rows: dedup (mtprun's "
        "RankDedupDispatcher), megatron (megatron-core's all-to-all dispatcher)",
    )  # fmt: skip
    parser.add_argument(
        "--balanced-routing", action="store_true",
        help="mtprun rows route on random logits (megatron-core's moe_router_force_load_"
        "balancing), taking the random-init router's uneven expert load out of ep's waits",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model-dir", type=Path, help="keep (and reuse) the model folders here")
    parser.add_argument("--profile", action="store_true", help="profile one mtprun step")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    args.device = "cpu" if args.cpu_dry_run else "cuda"
    shape = CPU_SHAPE if args.cpu_dry_run else MoEShape(layers=args.layers)
    if args.cpu_dry_run:
        args.seq, args.step_tokens, args.warmup, args.steps = 64, 256, 1, 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(shape, args.seq, args.model_dir or Path(tmp), args.device)
        for trainer, dispatcher in _runs(args):
            args.dispatcher = dispatcher
            if args.ep > 1:
                layout = {"dp": args.ep, "ep": args.ep}
                rows += spawn_ranks(_rank_process, args.ep, (folder, shape, args, layout),
                                    gpus=args.device == "cuda")  # fmt: skip
            else:
                rows.append(measure(trainer, folder, shape, args, {}))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
