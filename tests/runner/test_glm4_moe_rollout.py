"""vLLM serves a GLM-4.5 export (a folder written through `megatron_to_hf`, as the trainer's
export and weight transfer write it): greedy tokens and their log-probs equal transformers',
before and after a weight transfer and after a second one back. The folder exercises each
routing option on vLLM's CPU path: a dense first layer, sigmoid scores with the correction
bias, grouped top-k (2 groups, the best kept), routed scaling, a shared expert, q/k/v biases,
q/k norms and RoPE on half of each head. Its own module: the engine needs a process without
Megatron's groups."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.models.family import family_of
from mtprun.runner.rollout.engine import RolloutEngine
from mtprun.runner.run.export import save_hf_folder
from mtprun.spec.rollout import RolloutSection

from .qwen3_folders import build_glm4_moe_folder
from .test_rollout import MAX_TOKENS, _assert_matches_hf

pytestmark = pytest.mark.slow


def _through_megatron(folder):
    """The folder's tensors converted to Megatron-core names and back."""
    shape = ModelShape.from_model_dir(folder)
    return megatron_to_hf(hf_to_megatron(load_file(folder / "model.safetensors"), shape), shape)


def _glm_folder(tokenizer, out_dir, seed):
    """The GLM test folder without its MTP layer's tensors (`num_nextn_predict_layers` 0: this
    test is the trunk's). Its config.json, written from transformers' `Glm4MoeConfig`, names no
    head_dim, which vLLM's GLM model reads: the engine passes it (`vllm_config_overrides`)."""
    folder = build_glm4_moe_folder(tokenizer, out_dir, seed=seed)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["num_nextn_predict_layers"] = 0
    path.write_text(json.dumps(config, indent=2))
    weights = folder / "model.safetensors"
    past = f"model.layers.{config['num_hidden_layers']}."
    trunk = {n: t for n, t in load_file(weights).items() if not n.startswith(past)}
    save_file(trunk, str(weights), metadata={"format": "pt"})
    return folder


def _model_class(worker) -> str:
    return type(worker.model_runner.model).__name__


def test_vllm_serves_a_glm4_moe_export_and_its_weight_transfer(tokenizer, tmp_path):
    initial = _glm_folder(tokenizer, tmp_path / "initial", seed=0)
    exported = save_hf_folder(_through_megatron(initial), initial, tmp_path / "export")
    retrained = _glm_folder(tokenizer, tmp_path / "retrained", seed=2)
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    eos = tokenizer.eos_token_id
    greedy = RolloutSection(temperature=0.0, max_tokens=MAX_TOKENS)
    engine = RolloutEngine(exported, greedy, seed=0, work_dir=tmp_path / "engine")
    try:
        (served_by,) = engine.llm.collective_rpc(_model_class)
        before = engine.generate(prompts, n=1)
        engine.update_weights(_through_megatron(retrained).items(), version=1)
        after = engine.generate(prompts, n=1)
        engine.update_weights(_through_megatron(exported).items(), version=2)
        back = engine.generate(prompts, n=1)
    finally:
        engine.shutdown()
    assert served_by == family_of("Glm4MoeForCausalLM").vllm_architecture
    _assert_matches_hf(before, exported, prompts, eos)
    _assert_matches_hf(after, retrained, prompts, eos)
    _assert_matches_hf(back, exported, prompts, eos)
    assert [s[0].token_ids for s in after] != [s[0].token_ids for s in before]
