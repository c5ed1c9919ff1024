"""Qwen3.5 folders for the Qwen3.5 tests: the tiny builder's hybrid (3 Gated DeltaNet layers,
then a gated attention layer), with every norm weight, the decay parameters and the conv drawn
at random so that a swapped or mis-centred tensor shows (a fresh init has zero-centred norms at
0, the GDN output norm at 1)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedTokenizerBase,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
)

from mtprun.models import build_tiny_model
from mtprun.spec.model import TinyModel

# 4 query heads and 2 key/value heads of 32 channels (RoPE on 8 of them); GDN: 2 key heads
# read by 4 value heads (2 each), 64 channels each: tp=2 splits both kinds of layers.
QWEN3_5_TINY = {
    "hidden": 128,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 128,
    "max_seq_len": 256,
}


def randomize_qwen3_5(model: torch.nn.Module, seed: int) -> None:
    """Draw the tensors a fresh Qwen3.5 init leaves constant: zero-centred norms around 0,
    the GDN output norm around 1, A_log and dt_bias around their init values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                tensor.copy_(1.0 + 0.2 * noise)
            elif "norm" in name:
                tensor.copy_(0.2 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                tensor.add_(0.3 * noise)


def build_qwen3_5_folder(
    tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int, **tiny: object
) -> Path:
    """A random-init tiny Qwen3.5 (`QWEN3_5_TINY`, overridden by `tiny`) with its norms and
    decay parameters drawn (`randomize_qwen3_5`)."""
    spec = TinyModel(architecture="qwen3_5", **{**QWEN3_5_TINY, **tiny})
    folder = build_tiny_model(spec, tokenizer, out_dir, seed=seed)
    # transformers leaves the MTP tensors out of its model: drawn here, kept beside it.
    mtp = {n: t for n, t in load_file(folder / "model.safetensors").items() if n.startswith("mtp.")}
    g = torch.Generator().manual_seed(seed)
    for name, tensor in mtp.items():
        if "norm" in name:
            tensor.copy_(0.2 * torch.randn(tensor.shape, generator=g))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    randomize_qwen3_5(model, seed)
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if mtp:
        tensors = {**load_file(folder / "model.safetensors"), **mtp}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# A one-block vision tower, only for the checkpoint layout: mtprun never runs it.
_TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "num_position_embeddings": 64,
}


def build_qwen3_5_vl_folder(text_dir: Path, out_dir: Path, seed: int) -> Path:
    """The text model of `text_dir` as a `Qwen3_5ForConditionalGeneration` checkpoint
    (`model.language_model.` text tensors, config under `text_config`) with a random one-block
    vision tower under `model.visual.`."""
    text_config = AutoConfig.from_pretrained(text_dir)
    config = Qwen3_5Config(
        text_config=text_config.to_dict(),
        vision_config={**_TINY_VISION, "out_hidden_size": text_config.hidden_size},
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    tensors = {n: t for n, t in model.state_dict().items() if n.startswith("model.visual.")}
    for name, tensor in load_file(text_dir / "model.safetensors").items():
        tensors[name.replace("model.", "model.language_model.", 1)] = tensor
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(out_dir)
    for item in text_dir.iterdir():
        if item.name.startswith("tokenizer") or item.name == "chat_template.jinja":
            shutil.copy2(item, out_dir / item.name)
    return out_dir
