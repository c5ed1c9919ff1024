"""A checkpoint's HF folder written from the model's parts as they come: one
`model.safetensors` up to the shard size, else shards and their index as transformers writes
them; transformers, and mtprun's own reader, load exactly the tensors written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtprun.models.folder_tensors import folder_tensor_names
from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.trainer.model import read_hf_weights

from .test_rollout import _layer_parts


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _assert_loads_exactly(folder, weights: dict[str, torch.Tensor]) -> None:
    read = read_hf_weights(folder)
    assert read.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(read[name], tensor), name
    assert folder_tensor_names(folder) == set(weights)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name].float()), name


def test_parts_larger_than_a_shard_are_written_as_indexed_shards(tiny_qwen2_dir, tmp_path):
    weights = _weights(tiny_qwen2_dir)
    parts = [dict(part) for part in _layer_parts(weights)]
    smallest = min(sum(t.nbytes for t in part.values()) for part in parts)
    out = save_hf_folder(iter(parts), tiny_qwen2_dir, tmp_path / "hf", shard_bytes=smallest)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    count = len(files)
    assert count == len(parts)  # each part reaches the shard size on its own
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights.values())
    for name, file in index["weight_map"].items():
        assert name in load_file(out / file)
    assert not (out / "model.safetensors").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    _assert_loads_exactly(out, weights)


@pytest.mark.parametrize("as_parts", [True, False])
def test_a_model_within_one_shard_is_one_file(tiny_qwen2_dir, tmp_path, as_parts):
    weights = _weights(tiny_qwen2_dir)
    given = iter([dict(part) for part in _layer_parts(weights)]) if as_parts else weights
    out = save_hf_folder(given, tiny_qwen2_dir, tmp_path / "hf")
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    _assert_loads_exactly(out, weights)
