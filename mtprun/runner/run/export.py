"""HF-format policy folders: written at checkpoints, handed out by `mtprun export`."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtprun.runner.run import checkpoint

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


def export_checkpoint(checkpoints: Path, step: int | None, out_dir: Path) -> Path:
    """Copy the HF folder of checkpoint `step` (None = newest) to `out_dir`."""
    source = checkpoint.resolve(checkpoints, step) / "hf"
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is missing: the checkpoint was written incompletely")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(source, out_dir)
    return out_dir
