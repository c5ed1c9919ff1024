"""Tiny model folders: what they hold, that transformers loads them, and their errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtprun.data.tokenizer import build_tokenizer
from mtprun.models import ModelShape, build_tiny_model, hf_to_megatron
from mtprun.spec.model import TinyModel

from .conftest import TINY


def test_qwen2_folder_loads_in_transformers_with_the_saved_weights(tiny_qwen2_dir, tokenizer):
    config = json.loads((tiny_qwen2_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == TinyModel().vocab_size(len(tokenizer)) == 128
    assert config["eos_token_id"] == tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    saved = load_file(tiny_qwen2_dir / "model.safetensors")
    for name, param in model.state_dict().items():
        torch.testing.assert_close(param, saved[name], rtol=0, atol=0)
    loaded = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    assert loaded("12+3=").input_ids == tokenizer("12+3=").input_ids


def test_qwen3_folder_has_q_k_norms_no_biases_and_the_tiny_head_dim(tmp_path, tokenizer):
    spec = TinyModel(architecture="qwen3", **TINY)
    folder = build_tiny_model(spec, tokenizer, tmp_path, seed=0)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["head_dim"], config["attention_bias"]) == (spec.head_dim, False)
    saved = load_file(folder / "model.safetensors")
    assert saved["model.layers.0.self_attn.k_norm.weight"].shape == (spec.head_dim,)
    assert not any(name.endswith("_proj.bias") for name in saved)
    model = AutoModelForCausalLM.from_pretrained(folder)
    for name, param in model.state_dict().items():
        torch.testing.assert_close(param, saved[name], rtol=0, atol=0)
    # What validate reads from the tiny spec is what the trainer reads from the folder.
    from_spec = replace(ModelShape.from_tiny(spec, 128), config_path=str(folder / "config.json"))
    assert ModelShape.from_model_dir(folder) == from_spec


def test_mimo_folder_has_mtp_layers_in_vllm_naming(tiny_mimo_dir):
    config = json.loads((tiny_mimo_dir / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1
    saved = load_file(tiny_mimo_dir / "model.safetensors")
    hidden = TINY["hidden"]
    assert saved["model.mtp_layers.0.input_proj.weight"].shape == (hidden, 2 * hidden)
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        assert torch.equal(saved[f"model.mtp_layers.0.{name}.weight"], torch.ones(hidden))
    assert "model.mtp_layers.0.self_attn.q_proj.bias" in saved
    assert "model.mtp_layers.0.mlp.down_proj.weight" in saved
    # transformers reads the trunk as plain Qwen2 and leaves the MTP layers aside.
    model = AutoModelForCausalLM.from_pretrained(tiny_mimo_dir)
    torch.testing.assert_close(
        model.state_dict()["model.embed_tokens.weight"], saved["model.embed_tokens.weight"]
    )


def test_padded_vocab_splits_over_tensor_parallel_ranks(tmp_path):
    char = build_tokenizer("char")  # 105 tokens: no tp > 1 divides it
    folder = build_tiny_model(TinyModel(**TINY), char, tmp_path, seed=0)
    shape = ModelShape.from_model_dir(folder)
    assert len(char) == 105 and shape.vocab == 128
    shape.check_tp(2)
    hf = load_file(folder / "model.safetensors")
    shards = [
        hf_to_megatron(hf, shape, rank, 2)["embedding.word_embeddings.weight"] for rank in (0, 1)
    ]
    assert [s.shape[0] for s in shards] == [64, 64]
    torch.testing.assert_close(torch.cat(shards), hf["model.embed_tokens.weight"], rtol=0, atol=0)
    # transformers scores every id of the padded vocab; the tokenizer decodes padding to "".
    logits = AutoModelForCausalLM.from_pretrained(folder)(torch.tensor([[5, 6]])).logits
    assert logits.shape[-1] == 128
    assert char.decode([40, 120]) == char.decode([40])


def test_unpadded_vocab_is_refused_by_tensor_parallelism(tmp_path):
    char = build_tokenizer("char")
    folder = build_tiny_model(TinyModel(**TINY, vocab=len(char)), char, tmp_path, seed=0)
    with pytest.raises(
        ValueError, match=r"parallel.tp=2 does not divide the model's vocab_size=105"
    ):
        ModelShape.from_model_dir(folder).check_tp(2)


def test_tied_model_stores_the_embedding_once(tmp_path, tokenizer):
    spec = TinyModel(tie_embeddings=True, **TINY)
    folder = build_tiny_model(spec, tokenizer, tmp_path, seed=3)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert ModelShape.from_model_dir(folder).tie_embeddings


def test_seed_decides_the_weights(tmp_path, tokenizer):
    spec = TinyModel(**TINY)
    a = load_file(build_tiny_model(spec, tokenizer, tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(build_tiny_model(spec, tokenizer, tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(build_tiny_model(spec, tokenizer, tmp_path / "c", seed=2) / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden": 32, "heads": 2}, "head size"),
        ({"heads": 2, "kv_heads": 3}, "multiple of kv_heads"),
        ({"mtp_layers": 1}, "architecture: mimo"),
        ({"mtp_layers": 1, "architecture": "qwen3"}, "architecture: mimo"),
        ({"vocab": 10}, "smaller than the tokenizer"),
    ],
)
def test_bad_tiny_specs_are_refused(tmp_path, tokenizer, change, message):
    spec = TinyModel(**{**TINY, **change})
    with pytest.raises(ValueError, match=message):
        build_tiny_model(spec, tokenizer, tmp_path, seed=0)


def test_dims_refuse_unknown_architectures_and_missing_configs(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelShape.from_hf_config({"architectures": ["GPT2LMHeadModel"]}, source="x/config.json")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        ModelShape.from_model_dir(tmp_path)
