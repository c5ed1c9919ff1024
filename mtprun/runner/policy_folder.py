"""The policy folders of a checkpoint, written by the trainer and handed out by `mtprun export`:
an HF model folder (`hf/`: the whole policy, with LoRA its merged weights W + alpha / r B A)
and, for a LoRA run, a PEFT adapter folder (`adapter/`: the adapters alone, what a LoRA run
exports by default)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtprun.models.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config
from mtprun.spec.model import LoRASection

HF_FOLDER = "hf"  # a checkpoint's HF model folder
ADAPTER_FOLDER = "adapter"  # a LoRA checkpoint's PEFT adapter folder

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


def save_hf_folder(
    weights: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
    template_dir: Path,
    out_dir: Path,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write `weights` (HF names: one mapping, or parts of the model one after another, as
    `Trainer.hf_state_dict_chunks` yields them) into `out_dir` next to the config, tokenizer
    and generation config of `template_dir` (the run's initial model folder). Up to
    `shard_bytes` the folder holds `model.safetensors`; a larger model is written as it comes,
    in shards of about `shard_bytes` (`model-00001-of-0000N.safetensors` and
    `model.safetensors.index.json`, as transformers writes them), so the host holds one shard
    and one part at a time, not the model."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in template_dir.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, out_dir / item.name)
    parts = [weights] if isinstance(weights, Mapping) else weights
    written: list[tuple[Path, list[str]]] = []  # each shard's file and its tensors
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    for part in parts:
        for name, tensor in part.items():
            shard[name] = _host_copy(tensor)
            size += shard[name].nbytes
        if size >= shard_bytes:
            written.append(_write_shard(shard, out_dir / f".shard{len(written)}"))
            shard, total, size = {}, total + size, 0
    total += size
    if shard or not written:
        written.append(_write_shard(shard, out_dir / f".shard{len(written)}"))
    _name_shards(written, out_dir, total)
    return out_dir


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor of its own: safetensors refuses tensors that share memory (tied
    embeddings), and a GPU tensor's copy to the host is one already."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu").contiguous()
    return tensor.contiguous().clone()


def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> tuple[Path, list[str]]:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, list(tensors)


def _name_shards(written: list[tuple[Path, list[str]]], out_dir: Path, total: int) -> None:
    """The shards' final names, and with more than one the index transformers reads."""
    if len(written) == 1:
        written[0][0].rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, (path, names) in enumerate(written, start=1):
        final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


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
