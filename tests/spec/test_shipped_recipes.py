"""The recipes in recipes/ validate cleanly, and editors get a schema that matches the code."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jsonschema
import pytest
from ruamel.yaml import YAML

from mtprun.preflight import check_recipe
from mtprun.preflight.memory import GIB, recipe_trainer_memory
from mtprun.spec.schema import recipe_json_schema

from .test_model_families import QWEN3_8B

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SCHEMA_LINE = "# yaml-language-server: $schema=schema.json"
SHIPPED = sorted([*RECIPES.glob("*.yaml"), *RECIPES.glob("examples/*.yaml")])


def test_the_promised_recipes_are_shipped() -> None:
    names = {p.stem for p in SHIPPED}
    assert names >= {"quickstart", "sft-zloss", "grpo-agentic", "mtp-specdec", "megatron-tp2"}


def test_the_example_prompts_are_what_the_script_makes() -> None:
    import pyarrow.parquet as pq

    script = RECIPES / "examples" / "make_prompts.py"
    spec = importlib.util.spec_from_file_location("make_prompts", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert pq.read_table(RECIPES / "examples" / "prompts.parquet").equals(module.table())


# Qwen3-0.6B's and Qwen3-1.7B's config.json fields (tied embeddings, head size 128).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
QWEN3_1_7B = {**QWEN3_0_6B, "hidden_size": 2048, "intermediate_size": 6144}
# Example recipes serving a reward model from an HF folder CI does not hold: they validate
# against its config.json and a tokenizer config with a chat template, written to a temporary
# folder the override points the recipe at.
SERVED_REWARD_MODELS = {
    "reward-model-grpo": (
        "task.rewards.1.model",
        {
            **QWEN3_0_6B,
            "architectures": ["Qwen3ForSequenceClassification"],
            "id2label": {"0": "LABEL_0"},
        },
    ),
    "judge-grpo": ("task.reward.model", QWEN3_1_7B),
}


def served_model_overrides(stem: str, folder: Path) -> list[str]:
    """The override pointing recipe `stem`'s served reward model at a folder holding its
    config.json (none for the other recipes)."""
    if stem not in SERVED_REWARD_MODELS:
        return []
    key, config = SERVED_REWARD_MODELS[stem]
    (folder / "config.json").write_text(json.dumps(config))
    template = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(template))
    return [f"{key}={folder}"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_recipe_validates_without_errors_or_warnings(path: Path, tmp_path: Path) -> None:
    check = check_recipe(path, served_model_overrides(path.stem, tmp_path))
    assert [str(d) for d in check.diagnostics] == []
    assert check.recipe is not None and check.recipe.name == path.stem


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_recipe_points_editors_at_the_schema(path: Path) -> None:
    schema = Path(os.path.relpath(RECIPES / "schema.json", path.parent))
    assert path.read_text(encoding="utf-8").splitlines()[0] == SCHEMA_LINE.replace(
        "schema.json", schema.as_posix()
    )
    data = YAML(typ="safe").load(path)
    jsonschema.validate(data, json.loads((RECIPES / "schema.json").read_text()))


# Qwen3-30B-A3B's config.json fields (30.5B parameters, 3.3B active: 128 experts, top 8).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}

# GLM-4.5-Air's config.json fields (106B parameters, 12B active: a dense first layer, then 128
# routed experts, top 8, and a shared one; RoPE on half of each head; one MTP layer).
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": False,
    "vocab_size": 151552,
}

# Qwen3.5-9B's config.json (a vision-language checkpoint, its text model under text_config):
# 32 layers, every 4th gated attention (16 heads of 256, 4 key/value groups, RoPE on a quarter
# of each head), the others Gated DeltaNet (16 key heads and 32 value heads of 128), one MTP
# layer. Written from the model card and transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B
# style"); marked "unsure" are values not checked against the released file.
QWEN3_5_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "head_dim": 256,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,  # unsure
        "mtp_num_hidden_layers": 1,
        "num_attention_heads": 16,
        "num_hidden_layers": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,  # unsure
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "out_hidden_size": 4096},  # unsure
}
QWEN3_5_9B["text_config"]["layer_types"] *= 8  # the 4-layer pattern over 32 layers

# MiMo-7B's config.json (MiMo-7B-Base / -SFT / -RL share it): Qwen2's layout (biased q/k/v) with
# one MTP layer; marked "unsure" are values not checked against the released file.
MIMO_7B = {
    "architectures": ["MiMoForCausalLM"],
    "model_type": "mimo",
    "attention_bias": True,  # unsure
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 640000,  # unsure
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151680,
}

# Example recipes of real checkpoints, with the config.json of each: their model.path holds no
# weights in CI, so they validate above with the shape unknown, and here against the real one
# (the rules that read the shape, and the memory estimate held against gpu_memory_gib).
REAL_MODELS = {
    "qwen3-8b-grpo-math": QWEN3_8B,
    "qwen3-8b-lora-grpo": QWEN3_8B,
    "qwen3-30b-a3b-grpo": QWEN3_30B_A3B,
    "glm-4.5-air-sft-tools": GLM_45_AIR,
    "qwen3.5-9b-dapo-mtp": QWEN3_5_9B,
    "mimo-7b-dapo-mtp": MIMO_7B,
    "mimo-7b-search-r1-mtp": MIMO_7B,
}


@pytest.mark.parametrize("stem", sorted(REAL_MODELS))
def test_real_model_recipe_validates_against_its_config(tmp_path: Path, stem: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(REAL_MODELS[stem]))
    path = RECIPES / "examples" / f"{stem}.yaml"
    check = check_recipe(path, [f"model.path={tmp_path}"])
    assert [str(d) for d in check.diagnostics] == []
    memory = recipe_trainer_memory(check.recipe)
    assert not isinstance(memory, str)
    assert memory.total <= check.recipe.resources.gpu_memory_gib * GIB


def test_qwen3_8b_math_needs_its_bf16_optimizer_state(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    path = RECIPES / "examples" / "qwen3-8b-grpo-math.yaml"
    overrides = [f"model.path={tmp_path}", "trainer.optimizer_state=float32"]
    [warning] = [str(d) for d in check_recipe(path, overrides).diagnostics]
    assert "more than resources.gpu_memory_gib 80; optimizer state is the largest part" in warning
    assert "try trainer.optimizer_state: bfloat16" in warning


@pytest.mark.parametrize(
    ("stem", "override", "remedy"),
    [
        # megatron-core's selective recomputation leaves MoE layers' activations in memory.
        ("qwen3-30b-a3b-grpo", "trainer.recompute=selective", "try trainer.recompute: full"),
        (
            "glm-4.5-air-sft-tools",
            "trainer.optimizer_state=float32",
            "try trainer.optimizer_state: bfloat16",
        ),
    ],
)
def test_moe_examples_need_what_they_set_to_fit(
    tmp_path: Path, stem: str, override: str, remedy: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(REAL_MODELS[stem]))
    path = RECIPES / "examples" / f"{stem}.yaml"
    [warning] = [
        str(d) for d in check_recipe(path, [f"model.path={tmp_path}", override]).diagnostics
    ]
    assert "more than resources.gpu_memory_gib 80" in warning
    assert remedy in warning


def test_committed_schema_matches_the_code() -> None:
    committed = json.loads((RECIPES / "schema.json").read_text(encoding="utf-8"))
    assert committed == recipe_json_schema(), "regenerate: mtprun schema -o recipes/schema.json"


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        ({"name": "x", "model": {"tiny": {}}, "lossses": []}, "lossses"),
        ({"name": "x", "model": {"tiny": {"heads": "four"}}}, "four"),
        ({"name": "x", "model": {"tiny": {}}, "losses": [{"kind": "focal"}]}, "focal"),
        ({"name": "x", "model": {"tiny": {}}, "mask": {"bob": True}}, "bob"),
    ],
)
def test_schema_rejects_what_the_loader_rejects(data: dict, complaint: str) -> None:
    with pytest.raises(jsonschema.ValidationError, match=complaint):
        jsonschema.validate(data, recipe_json_schema())


def test_schema_accepts_extends_and_documents_every_field() -> None:
    schema = recipe_json_schema()
    jsonschema.validate({"extends": ["a.yaml"], "name": "x", "model": {"tiny": {}}}, schema)
    undocumented = [
        f"{section}.{name}"
        for section, definition in [("<recipe>", schema), *schema["$defs"].items()]
        for name, field in definition.get("properties", {}).items()
        if "description" not in field
    ]
    assert undocumented == []
