"""The trainer against its peers on the GPU (issue 15's bench): step time, tokens/s, MFU and
peak memory of a training step of 16384 tokens, random-init models of Qwen2.5 and Qwen3 shapes.

Trainers, each built from the same random-init HF folder and fed the same tokens:
- mtprun: `mtprun.runner.trainer.trainer.Trainer` (bf16, AdamW, grad_clip 1.0), all sequences of
  one length packed into micro batches of `--micro-batch-tokens`; timing `train_step`.
- hf: transformers' model of the shape's family (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`) in
  bf16, SDPA attention, the same micro batches as
  [micro tokens / S, S] with gradients accumulated over the step, float32 full-logit loss,
  grad clip 1.0, `torch.optim.AdamW(fused=True)` on the bf16 weights.
- liger: the same after Liger-Kernel's RoPE / RMSNorm / SwiGLU patches, and for sft its
  fused linear cross entropy (Liger's fused GRPO loss takes one advantage per sequence, not
  one per token, so grpo keeps the full-logit loss). Skipped where liger_kernel is missing,
  and for Qwen3 shapes (the patches here are Qwen2's).
Workloads: sft (loss `ce`) and grpo (`grpo` with a k3 KL, kl_coef 0.05, and the entropy
metric; the peers compute the same from their full logits). The model folder is built once
(on the GPU, in bf16), each trainer anew per row and freed after it. Each row is printed as
a JSON line as soon as it is measured (and `--json` rewritten), a markdown table closes the
run; an out-of-memory row reads OOM and the run goes on. With `--tp N` / `--cp N` only
mtprun runs, on N processes and GPUs; the last rank reports (peak: the largest rank's).

    python bench/trainer_gpu.py                                    # 1.5B shape, one H100
    python bench/trainer_gpu.py --shape 7b --tp 2                  # 7B, two H200
    python bench/trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 \\
        --seq 2048 --micro-batch-tokens 4096                       # issue 24 (a), two H100
    python bench/trainer_gpu.py --cp 2 --seq 32768                 # 1.5B, two H200
    python bench/trainer_gpu.py --seq 2048 --workload sft --micro-batch-tokens 4096 \\
        --recompute selective --json $OUT/rows.json
    python bench/trainer_gpu.py --mixed-lengths --trainers mtprun   # RL-like packed rows
    python bench/trainer_gpu.py --cpu-dry-run                      # tiny sizes on CPU
    python bench/trainer_gpu.py --cpu-dry-run --shape qwen3-8b --tp 2  # a tiny Qwen3, 2 ranks
    python bench/trainer_gpu.py --shape qwen3-8b --lora 64 --trainers mtprun,hf \
        --seq 2048 --micro-batch-tokens 4096                       # issue 25: LoRA vs peft
    python bench/trainer_gpu.py --shape qwen3.5-9b --layers 16 --trainers mtprun,hf \
        --workload sft --seq 2048 --micro-batch-tokens 4096        # issue 27: Qwen3.5
    python bench/trainer_gpu.py --shape qwen3.5-9b --layers 8 --trainers mtprun \
        --workload sft --seq 2048 --micro-batch-tokens 4096 --profile $OUT/prof
        # + one profiled step a row: kernels, idle gaps, host syncs by caller

With `--lora R` every trainer trains LoRA adapters of rank R (alpha 2R, no dropout) on every
linear layer of the decoder (q/k/v/o, gate/up/down) over frozen bf16 weights: mtprun's
`model.lora`, and peft's `get_peft_model` on the transformers model for the hf row. A LoRA
step computes no weight gradient of the frozen base: its model FLOPs count 4 (not 6) x the
frozen parameters a token (forward 2, input gradients 2), 6 x the adapters' and the same
attention term. `--layers N` cuts the shape to its first N layers (to compare with a full
fine-tune that does not fit the whole model). The Qwen3.5 shape (Gated DeltaNet and gated
attention) is `bench/hybrid_shape.py`'s, FLOPs counted as its docstring says; its hf row runs
flash-linear-attention's kernels where transformers finds `fla` installed.

Qwen3-8B at tp 2 holds 4.1B parameters a rank: bf16 weights 7.6 GiB, float32 main gradients
15.3 GiB, float32 master weights 15.3 GiB and AdamW's float32 moments 30.5 GiB leave no room for
activations on an 80 GB H100 (the trainer refuses it before allocating: TrainerDoesNotFit);
`--optimizer-state bfloat16` (`trainer.optimizer_state`) halves the moments.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_smoke_megatron import random_batch, random_lengths, smoke_recipe, spawn_ranks
from hybrid_shape import CPU_QWEN3_5, QWEN3_5_9B, HybridShape

from mtprun.compiler import compile_recipe
from mtprun.data.batch import PackedBatch
from mtprun.data.tokenizer import build_tokenizer
from mtprun.losses.grpo import GRPOTerm
from mtprun.models.tiny import build_tiny_model
from mtprun.spec.model import LoRASection, TinyModel

TRAINERS = ("mtprun", "hf", "liger")
WORKLOADS: dict[str, list[dict]] = {
    "sft": [{"kind": "ce"}],
    "grpo": [{"kind": "grpo", "kl_coef": 0.05, "kl_estimator": "k3"}, {"kind": "entropy"}],
}
GRPO = GRPOTerm(**WORKLOADS["grpo"][0])  # the peers' GRPO loss takes its parameters
LR = 1e-4  # smoke_recipe's, for the peers too
GRAD_CLIP = 1.0
MFU_FORMULA = (
    "MFU = [6 (non-embedding params + H V) tokens + 6 L Q s tokens] / step time / "
    "({peak:g} TFLOP/s x GPUs); H hidden, Q query width (heads x head_dim; = H for every "
    "shape here), V vocab, L layers, s sequence length, tokens per step (sequences of mixed "
    "lengths s_i: 6 L Q sum s_i^2 in place of 6 L Q s tokens); Qwen3's q/k RMSNorms count "
    "as their 2 head_dim parameters a layer in the 6 N term and their elementwise work is "
    "not counted (both < 1e-5 of the step's FLOPs)"
)


@dataclass(frozen=True)
class Shape:
    """A model shape; head_dim is hidden / heads (so for every shape here)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    architecture: str = "qwen2"  # qwen2: q/k/v biases; qwen3: per-head q/k RMSNorms instead

    def tiny(self, max_seq_len: int) -> TinyModel:
        return TinyModel(
            architecture=self.architecture, hidden=self.hidden, layers=self.layers,
            heads=self.heads, kv_heads=self.kv_heads, intermediate=self.ffn, vocab=self.vocab,
            tie_embeddings=False, max_seq_len=max_seq_len,
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def body_params(self) -> int:
        """Parameters outside the embedding and output layer: q/k/v biases (Qwen2) or the
        per-head q/k norms (Qwen3)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.architecture == "qwen3":
            attention += 2 * self.head_dim
        else:
            attention += q + 2 * kv
        return self.layers * (attention + 3 * h * self.ffn + 2 * h) + h

    def lora_params(self, rank: int) -> int:
        """Parameters of rank-`rank` adapters on every decoder linear layer: r (in + out)
        for each of q, k, v, o, gate, up, down."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        widths = [(h, q), (h, kv), (h, kv), (q, h), (h, self.ffn), (h, self.ffn), (self.ffn, h)]
        return self.layers * rank * sum(i + o for i, o in widths)

    def step_flops(self, lengths: list[int], lora_rank: int = 0) -> float:
        """Model FLOPs of one step (forward + backward) over sequences of `lengths`: the
        numerator of MFU_FORMULA; with LoRA the frozen weights count 4 a token, not 6."""
        base = self.body_params + self.hidden * self.vocab
        if lora_rank:
            dense = (4 * base + 6 * self.lora_params(lora_rank)) * sum(lengths)
        else:
            dense = 6 * base * sum(lengths)
        query = self.heads * self.head_dim
        return dense + 6 * self.layers * query * sum(n * n for n in lengths)


SHAPES = {
    "1.5b": Shape("1.5b", 1536, 28, 12, 2, 8960, 151936),  # Qwen2.5-1.5B
    "7b": Shape("7b", 3584, 28, 28, 4, 18944, 152064),  # Qwen2.5-7B
    "qwen3-8b": Shape("qwen3-8b", 4096, 36, 32, 8, 12288, 151936, "qwen3"),  # Qwen3-8B
    "qwen3.5-9b": QWEN3_5_9B,  # Gated DeltaNet + gated attention (bench/hybrid_shape.py)
}
# --cpu-dry-run: the family of the --shape asked for at tiny sizes (tp 2 divides the KV heads).
CPU_SHAPES = {
    "qwen2": Shape("cpu-tiny", 128, 2, 4, 2, 256, 256),
    "qwen3": Shape("cpu-tiny-qwen3", 128, 2, 4, 2, 256, 256, "qwen3"),
    "qwen3_5": CPU_QWEN3_5,
}


@dataclass(frozen=True)
class Config:
    """One configuration: the step holds `step_tokens` tokens as sequences of `seq`, every
    trainer takes them in micro batches of `micro_tokens` (whole sequences; 0 when a sequence
    is longer than the micro batches asked for). `mixed`: sequences of random lengths in
    [seq/2, 3 seq/2] instead (as RL rollouts are; one micro batch per step)."""

    shape: Shape
    workload: str
    seq: int
    step_tokens: int
    micro_tokens: int
    mixed: bool = False

    @classmethod
    def of(
        cls, shape: Shape, workload: str, seq: int, step: int, micro: int | None, mixed: bool
    ) -> Config:
        """`micro` None: one micro batch per step."""
        step = max(step, seq)  # a sequence longer than the step is a step of its own
        if step % seq:
            raise SystemExit(f"{step} tokens per step are no whole number of {seq}-token sequences")
        if mixed and micro not in (None, step):
            raise SystemExit("--mixed-lengths runs one micro batch per step")
        micro = step if micro is None else micro // seq * seq
        if micro and step % micro:
            raise SystemExit(f"seq {seq}: {step} step tokens are no whole number of {micro}")
        return cls(shape, workload, seq, step, micro, mixed)

    def lengths(self) -> list[int]:
        """The step's sequence lengths (seeded: the same on every call)."""
        if not self.mixed:
            return [self.seq] * (self.step_tokens // self.seq)
        g = torch.Generator().manual_seed(self.seq)
        return random_lengths(self.step_tokens, self.seq // 2, self.seq * 3 // 2, g)

    @property
    def rl(self) -> bool:
        return self.workload == "grpo"

    def step_batch(self, device: str) -> PackedBatch:
        """The step's tokens as one packed row (the peers' [B, S] view), the same on every
        call and for every micro batch size."""
        batch = random_batch(self.shape.vocab, self.step_tokens, 0, self.rl, "cpu", self.lengths())
        return _near_policy(batch, self.shape.vocab).to(device)

    def micro_batches(self, device: str) -> list[PackedBatch]:
        """The step's tokens in micro batches of `micro_tokens`."""
        batch, size = self.step_batch(device), self.micro_tokens
        if size == self.step_tokens:
            return [batch]
        cu = torch.arange(0, size + 1, self.seq, dtype=torch.int32, device=device)
        parts = []
        for start in range(0, self.step_tokens, size):
            part = {f.name: getattr(batch, f.name) for f in fields(PackedBatch)}
            part = {k: v if v is None else v[start : start + size] for k, v in part.items()}
            parts.append(PackedBatch(**{**part, "cu_seqlens": cu}))
        return parts


@dataclass
class Measured:
    times: list[float]
    first_loss: float
    micro_batch: str
    note: str = ""


def _near_policy(batch: PackedBatch, vocab: int) -> PackedBatch:
    """Old and reference log-probs near a random-init policy's (about -ln V for every token),
    so that GRPO's ratios are near 1 and both clip branches occur, as in training."""
    if batch.old_logprobs is None:
        return batch
    g = torch.Generator().manual_seed(1)
    base = torch.full_like(batch.old_logprobs, -math.log(vocab))
    batch.old_logprobs = base + 0.1 * torch.randn(base.shape, generator=g)
    batch.ref_logprobs = base + 0.1 * torch.randn(base.shape, generator=g)
    return batch


def time_steps(
    step: Callable[[], Any], warmup: int, steps: int, device: str
) -> tuple[list[float], float]:
    """Run `warmup` + `steps` steps; the timed steps' seconds (synchronized around each) and
    the first step's loss."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, first_loss = [], math.nan
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        loss = step()
        if i == 0:
            first_loss = float(loss)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, first_loss


def run_mtprun(cfg: Config, folder: Path, args: argparse.Namespace, layout: dict) -> Measured:
    from mtprun.runner.trainer.trainer import Trainer

    trainer_section = {
        "micro_batch_tokens": cfg.micro_tokens,
        "recompute": args.recompute,
        "optimizer_state": args.optimizer_state,
    }
    losses = WORKLOADS[cfg.workload]
    recipe = smoke_recipe(folder, args.dtype, losses, cfg.rl, trainer_section, layout)
    if args.lora:
        lora = {"rank": args.lora, "targets": ["all"]}
        recipe = recipe.model_copy(
            update={"model": recipe.model.model_copy(update={"lora": LoRASection(**lora)})}
        )
    trainer = Trainer(recipe, folder, compile_recipe(recipe), args.device)
    # On the host, as the product hands them over: the trainer moves each to the GPU itself
    # and reads the sequence boundaries from the host copy.
    batches = cfg.micro_batches("cpu")
    times, loss = time_steps(
        lambda: trainer.train_step(batches)["loss"], args.warmup, args.steps, args.device
    )
    if args.profile:
        path = args.profile / f"{cfg.workload}-{cfg.seq}.json"
        _profile_step(lambda: trainer.train_step(batches), path)
    micro = f"{cfg.micro_tokens} tok x{len(batches)}"
    mixed = ", lengths in [s/2, 3s/2]" if cfg.mixed else ""
    moments = args.optimizer_state if args.dtype == "bfloat16" else "float32"  # CPU: float32
    note = f"recompute {args.recompute}, {moments} moments{mixed}"
    if args.lora:
        note += f", LoRA r={args.lora} all linear"
    return Measured(times, loss, micro, note)


def _profile_step(step: Callable[[], Any], path: Path) -> None:
    """One more step under torch.profiler, summarized by bench/profile_step.py into `path`."""
    from profile_step import summarize, sync_sites
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # --cpu-dry-run: no device, no syncs to count
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = summarize(prof, top=40)
    if cuda:
        summary["sync_sites"] = sync_sites(step, top=40)
    path.write_text(json.dumps(summary, indent=1))
    print(f"profile: {path}", flush=True)


@contextlib.contextmanager
def _liger_patched(model: torch.nn.Module, fused_ce: bool) -> Iterator[str]:
    """Liger-Kernel's Qwen2 patches on `model`; the module-level names it also replaces
    (RoPE is looked up at run time) are restored afterwards, so later hf rows stay plain."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    from transformers.models.qwen2 import modeling_qwen2

    names = ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP")
    saved = {name: getattr(modeling_qwen2, name) for name in names}
    try:
        apply_liger_kernel_to_qwen2(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
            fused_linear_cross_entropy=fused_ce, model=model,
        )  # fmt: skip
        loss = "fused linear CE" if fused_ce else "full-logit GRPO loss"
        yield f"Liger RoPE, RMSNorm, SwiGLU; {loss}"
    finally:
        for name, value in saved.items():
            setattr(modeling_qwen2, name, value)


def run_hf(cfg: Config, folder: Path, args: argparse.Namespace, liger: bool) -> Measured:
    """transformers' model of the folder (Qwen2, Qwen3) with a plain training loop (with
    Liger's Qwen2 patches when `liger`)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model.to(args.device).train()
    if args.lora:
        model = _peft_lora(model, args.lora)
    # The same micro batches as mtprun's, gradients accumulated; each micro batch's mean
    # loss weighted by its share of the step's trained tokens (= the step's token mean).
    parts = cfg.micro_batches(args.device)
    trained = [int(part.loss_mask.sum()) for part in parts]
    shares = [n / sum(trained) for n in trained]
    fused_ce = liger and not cfg.rl
    with contextlib.ExitStack() as stack:
        note = "SDPA; float32 full-logit loss"
        if args.lora:
            note += f"; peft LoRA r={args.lora}, float32 adapters"
        if liger:
            note = stack.enter_context(_liger_patched(model, fused_ce))
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0, fused=True)

        def micro_loss(part: PackedBatch) -> torch.Tensor:
            ids = part.input_ids.view(-1, cfg.seq)
            if fused_ce:
                labels = part.targets.masked_fill(~part.loss_mask, -100).view_as(ids)
                return model(input_ids=ids, shift_labels=labels, use_cache=False).loss
            logits = model(input_ids=ids, use_cache=False).logits.flatten(0, 1)
            return _full_logit_loss(logits, part)

        def step() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=args.device)
            for part, share in zip(parts, shares, strict=True):
                loss = micro_loss(part) * share
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(trained, GRAD_CLIP)
            optimizer.step()
            return total

        times, loss = time_steps(step, args.warmup, args.steps, args.device)
    rows = cfg.micro_tokens // cfg.seq
    return Measured(times, loss, f"[{rows}, {cfg.seq}] x{len(parts)}", note)


def _peft_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` with peft's LoRA of rank `rank` (alpha 2 rank) on every decoder linear layer,
    the base frozen; adapters in float32 (peft's autocast_adapter_dtype default)."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(model, config)


def _full_logit_loss(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """sft: float32 cross entropy over the trained tokens. grpo: the token mean of
    -min(r A, clip(r) A) + kl_coef k3 with r = exp(logp - old), as mtprun.losses.grpo, and
    the entropy metric (computed, not trained: coef 0)."""
    if batch.advantages is None:
        labels = batch.targets.masked_fill(~batch.loss_mask, -100)
        return F.cross_entropy(logits.float(), labels)
    _mean_entropy(logits.detach(), batch.loss_mask)
    logp = -F.cross_entropy(logits.float(), batch.targets, reduction="none")
    assert batch.old_logprobs is not None and batch.ref_logprobs is not None
    ratio = torch.exp(logp - batch.old_logprobs)
    clipped = ratio.clamp(1 - GRPO.clip_low, 1 + GRPO.clip_high)
    per_token = -torch.minimum(ratio * batch.advantages, clipped * batch.advantages)
    delta = logp - batch.ref_logprobs
    per_token = per_token + GRPO.kl_coef * (torch.exp(-delta) + delta - 1)  # k3
    return (per_token * batch.loss_mask).sum() / batch.loss_mask.sum()


@torch.no_grad()
def _mean_entropy(logits: torch.Tensor, mask: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """Token mean of the softmax entropy over the trained rows, `rows` rows at a time."""
    total = logits.new_zeros((), dtype=torch.float32)
    for z, m in zip(logits.split(rows), mask.split(rows), strict=True):
        z = z.float()
        entropy = z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)
        total += (entropy * m).sum()
    return total / mask.sum()


def measure(
    trainer: str, cfg: Config, folder: Path, args: argparse.Namespace, layout: dict
) -> dict:
    """One row: `trainer` on `cfg`; OOM and other failures become the row's error."""
    world = layout.get("tp", 1) * layout.get("cp", 1)
    row: dict[str, Any] = {
        "trainer": trainer,
        "shape": cfg.shape.name,
        "workload": cfg.workload,
        "seq": cfg.seq,
        "step_tokens": cfg.step_tokens,
        **({"layout": layout} if world > 1 else {}),
    }
    skip = _skip_reason(trainer, cfg, args)
    if skip:
        return {**row, "skipped": skip}
    _free_memory(args.device)
    measured = None
    try:
        if trainer == "mtprun":
            measured = run_mtprun(cfg, folder, args, layout)
        else:
            measured = run_hf(cfg, folder, args, liger=trainer == "liger")
    except Exception as error:  # every configuration gets its row
        oom = isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)
        if not oom:
            traceback.print_exc()
        row["error"] = "OOM" if oom else f"{type(error).__name__}: {error}"[:300]
    peak = _peak_gib(args.device)
    _free_memory(args.device)
    if measured is None:
        return {**row, "peak_GiB": peak}
    step = statistics.median(measured.times)
    flops = cfg.shape.step_flops(cfg.lengths(), args.lora)
    return {
        **row,
        "micro_batch": measured.micro_batch,
        "step_s": round(step, 4),
        "tokens_per_s": round(cfg.step_tokens / step),
        "mfu": round(flops / step / (args.peak_tflops * 1e12 * world), 4),
        "peak_GiB": peak,
        "first_loss": round(measured.first_loss, 4),
        "timed_steps": [round(t, 4) for t in measured.times],
        "note": measured.note,
    }


def _skip_reason(trainer: str, cfg: Config, args: argparse.Namespace) -> str:
    if trainer == "liger":
        if args.device != "cuda":
            return "Liger-Kernel needs CUDA"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not installed"
        if cfg.shape.architecture != "qwen2":
            return "the Liger patches here are Qwen2's"
    if cfg.mixed and trainer != "mtprun":
        return "the peers' [B, S] micro batches need sequences of one length"
    if not cfg.micro_tokens:
        micro = args.micro_batch_tokens
        return f"a {cfg.seq}-token sequence does not fit {micro}-token micro batches"
    return ""


def _peak_gib(device: str) -> float | None:
    """This process's peak allocated GiB since the last reset (the largest over the process
    group when there are several ranks)."""
    if device != "cuda":
        return None
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return round(float(peak) / 2**30, 2)


def _free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_rows(folder: Path, args: argparse.Namespace, layout: dict, report: bool) -> list[dict]:
    """Every configuration, mtprun first and then the peers; rows printed as measured."""
    rows = []
    for cfg in args.configs:
        for trainer in args.trainers:
            rows.append(measure(trainer, cfg, folder, args, layout))
            if report:
                print(json.dumps(rows[-1]), flush=True)
                if args.json:  # after every row, so that a run cut short leaves its rows
                    args.json.write_text(json.dumps(rows, indent=2))
    return rows


def _rank_process(
    rank: int, port: int, out: Path, folder: Path, args: argparse.Namespace, layout: dict
) -> None:
    """mtprun's rows on rank `rank` of `layout`; the last rank reports and writes `out`."""
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
    from mtprun.spec.parallel import ParallelSection

    parallel = ParallelSection(**layout)
    init_parallel(parallel, rank, parallel.world_size, "127.0.0.1", port)
    last = rank == parallel.world_size - 1
    rows = run_rows(folder, args, layout, report=last)
    if last:
        out.write_text(json.dumps(rows))
    destroy_parallel()


@contextlib.contextmanager
def _defaults(dtype: torch.dtype, device: str) -> Iterator[None]:
    """torch's default dtype and device for the tensors created inside."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(saved)


def model_folder(
    shape: Shape | HybridShape, max_seq: int, root: Path, dtype: str, device: str
) -> Path:
    """The shape's random-init HF folder under `root`, built unless it is there already.
    `build_tiny_model` runs with `dtype` and `device` as torch's defaults, so the weights
    are written in `dtype` and drawn on the GPU (seconds; a 7B model takes minutes on CPUs);
    the CPU is the fallback."""
    folder = root / f"{shape.name}-{dtype}"
    if (folder / "config.json").exists():
        print(f"model folder: {folder} (reused)", flush=True)
        return folder
    start = time.perf_counter()
    max_seq, tokenizer = max(max_seq, 32768), build_tokenizer("char")  # Qwen2.5's

    def build() -> None:
        if isinstance(shape, HybridShape):
            shape.build_folder(folder, max_seq, tokenizer)
        else:
            build_tiny_model(shape.tiny(max_seq), tokenizer, folder, seed=0)

    try:
        with _defaults(getattr(torch, dtype), device):
            build()
    except Exception:
        if device == "cpu":
            raise
        traceback.print_exc()
        print("building the model folder on the GPU failed; building it on the CPU")
        with _defaults(getattr(torch, dtype), "cpu"):
            build()
    _free_memory(device)
    print(f"model folder: {folder} ({time.perf_counter() - start:.0f} s)", flush=True)
    return folder


def markdown_table(rows: list[dict]) -> str:
    head = "| trainer | shape | workload | seq | micro batch | step | tokens/s | MFU | peak | "
    head += "first loss | note |\n|---|---|---|---|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        peak = "-" if r.get("peak_GiB") is None else f"{r['peak_GiB']} GiB"
        if "step_s" in r:
            cells = [
                r["micro_batch"], f"{r['step_s']:.3f} s", f"{r['tokens_per_s'] / 1e3:.1f}k",
                f"{100 * r['mfu']:.1f}%", peak, f"{r['first_loss']:.4f}", r["note"],
            ]  # fmt: skip
        elif r.get("error") == "OOM":
            cells = ["-", "OOM", "-", "-", peak if peak == "-" else f"> {peak}", "-", ""]
        else:
            failure = r.get("error") or f"skipped: {r['skipped']}"
            cells = ["-", "-", "-", "-", peak, "-", failure.splitlines()[0].replace("|", "/")]
        layout = "".join(f" {k}={v}" for k, v in r.get("layout", {}).items())
        first = [r["trainer"] + layout, r["shape"], r["workload"], r["seq"]]
        lines.append("| " + " | ".join(map(str, first + cells)) + " |")
    return "\n".join(lines)


def _versions() -> str:
    import megatron.core
    import transformers

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    parts.append(f"megatron-core {megatron.core.__version__}")
    if importlib.util.find_spec("liger_kernel") is not None:
        from importlib.metadata import version

        parts.append(f"liger-kernel {version('liger-kernel')}")
    return ", ".join(parts)


def parse_args() -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    def names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
        def parse(text: str) -> list[str]:
            picked = text.split(",")
            if unknown := set(picked) - set(choices):
                raise argparse.ArgumentTypeError(f"{sorted(unknown)} not in {choices}")
            return picked

        return parse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU, float32")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--seq", type=ints, help="sequence lengths (default 512,2048,8192)")
    parser.add_argument("--workload", type=names(tuple(WORKLOADS)), default=list(WORKLOADS))
    parser.add_argument("--trainers", type=names(TRAINERS), default=list(TRAINERS))
    parser.add_argument("--steps", type=int, help="timed steps (default 5; 2 on CPU)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 2; 1 on CPU)")
    parser.add_argument("--step-tokens", type=int, help="tokens per step (default 16384)")
    parser.add_argument(
        "--micro-batch-tokens", type=int, help="tokens per micro batch, every trainer "
        "(mtprun's trainer.micro_batch_tokens; default: the step's, one micro batch per step)",
    )  # fmt: skip
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    parser.add_argument(
        "--optimizer-state", choices=("float32", "bfloat16"), default="float32",
        help="mtprun's trainer.optimizer_state: the dtype of AdamW's moments (bf16 weights)",
    )  # fmt: skip
    parser.add_argument(
        "--mixed-lengths", action="store_true",
        help="sequences of random lengths in [seq/2, 3 seq/2] (mtprun only; one micro batch)",
    )  # fmt: skip
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on every linear layer")
    parser.add_argument("--layers", type=int, help="the shape's first N layers only")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (mtprun only)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks (mtprun only)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, for MFU")
    parser.add_argument("--model-dir", type=Path, help="keep (and reuse) the model folders here")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument(
        "--profile", type=Path,
        help="one more mtprun step of each row under torch.profiler: DIR/<workload>-<seq>.json",
    )  # fmt: skip
    args = parser.parse_args()
    cpu = args.cpu_dry_run
    args.device, args.dtype = ("cpu", "float32") if cpu else ("cuda", "bfloat16")
    args.shape = CPU_SHAPES[SHAPES[args.shape].architecture] if cpu else SHAPES[args.shape]
    if args.layers:
        args.shape = replace(
            args.shape, name=f"{args.shape.name}-{args.layers}l", layers=args.layers
        )
    args.seq = args.seq or ([16, 64] if cpu else [512, 2048, 8192])
    args.steps = args.steps or (2 if cpu else 5)
    args.warmup = (1 if cpu else 2) if args.warmup is None else args.warmup
    args.step_tokens = args.step_tokens or (128 if cpu else 16384)
    args.configs = [
        Config.of(
            args.shape, workload, seq, args.step_tokens, args.micro_batch_tokens, args.mixed_lengths
        )
        for workload in args.workload
        for seq in args.seq
    ]
    if args.tp * args.cp > 1 and args.trainers != ["mtprun"]:
        print("--tp/--cp: only the mtprun trainer runs (the peers are single-GPU loops)")
        args.trainers = ["mtprun"]
    return args


def main() -> None:
    args = parse_args()
    from transformers.utils import logging

    logging.disable_progress_bar()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --cpu-dry-run to check the script on CPU")
        print(f"device: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}")
    print(_versions())
    shape: Shape = args.shape
    print(MFU_FORMULA.format(peak=args.peak_tflops))
    print(
        f"shape {shape}: non-embedding params {shape.body_params:.4g}, "
        f"H V {shape.hidden * shape.vocab:.4g}; {args.steps} timed steps (median) "
        f"after {args.warmup} warm-up; {args.step_tokens} tokens per step",
        flush=True,
    )
    layout = {"tp": args.tp, "cp": args.cp}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_dir or Path(tmp)
        folder = model_folder(shape, max(args.seq), root, args.dtype, args.device)
        if args.tp * args.cp > 1:
            spawn_args = (folder, args, layout)
            rows = spawn_ranks(_rank_process, args.tp * args.cp, spawn_args, args.device == "cuda")
        else:
            rows = run_rows(folder, args, {}, report=True)
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
