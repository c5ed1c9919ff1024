"""The policy folders of a checkpoint, written by the trainer and handed out by `mtprun export`:
an HF model folder (`hf/`: the whole policy, with LoRA its merged weights W + alpha / r B A)
and, for a LoRA run, a PEFT adapter folder (`adapter/`: the adapters alone, what a LoRA run
exports by default)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtprun.models.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config
from mtprun.spec.model import LoRASection

HF_FOLDER = "hf"  # a checkpoint's HF model folder
ADAPTER_FOLDER = "adapter"  # a LoRA checkpoint's PEFT adapter folder

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")


def save_hf_folder(
    state_dict: Mapping[str, torch.Tensor], template_dir: Path, out_dir: Path
) -> Path:
    """Write `state_dict` (HF names) as `out_dir/model.safetensors` next to the config,
    tokenizer and generation config of `template_dir` (the run's initial model folder)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in template_dir.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, out_dir / item.name)
    # safetensors refuses tensors that share memory (tied embeddings): store plain copies.
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def save_peft_adapter(
    adapters: Mapping[str, torch.Tensor], lora: LoRASection, base_model: str, out_dir: Path
) -> Path:
    """Write `adapters` (PEFT names, `Trainer.adapter_state_dict`) as a PEFT adapter folder of
    `lora` on `base_model` (recorded as base_model_name_or_path): `adapter_config.json` and
    `adapter_model.safetensors`, which peft's `PeftModel.from_pretrained` and vLLM's LoRA
    loader read."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = adapter_config(lora, base_model)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in adapters.items()}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out_dir
