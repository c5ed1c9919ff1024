"""The model-family registry and what `mtprun validate` / `plan` read from a family's folder
or tiny spec (no torch: shapes and rules only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtprun.models import families
from mtprun.models.families import (
    FAMILIES,
    FAMILY_UNITS,
    SUPPORTED_ARCHITECTURES,
    TINY_ARCHITECTURES,
)
from mtprun.models.family import FamilyUnit
from mtprun.models.shape import ModelShape
from mtprun.preflight import check_recipe
from mtprun.preflight.memory import parameters
from mtprun.spec.families import FAMILY_REGISTRY
from mtprun.spec.model import TinyModel

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

# Qwen3-8B's config.json fields (8.19B parameters; head_dim 128 with hidden 4096 / 32 heads).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


def test_lists_of_architectures_come_from_the_families():
    assert SUPPORTED_ARCHITECTURES == (
        "Qwen2ForCausalLM",
        "LlamaForCausalLM",
        "MiMoForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Glm4MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
    )
    assert {f.vllm_architecture for f in FAMILIES} >= set(SUPPORTED_ARCHITECTURES)
    assert TINY_ARCHITECTURES == {
        "qwen2": "Qwen2ForCausalLM",
        "mimo": "MiMoForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
        "qwen3_5": "Qwen3_5ForCausalLM",
    }
    tiny_names = set(TinyModel.model_fields["architecture"].annotation.__args__)
    assert tiny_names == set(TINY_ARCHITECTURES)


def test_qwen3_config_reads_its_norms_biases_and_head_dim():
    shape = ModelShape.from_hf_config(QWEN3_8B)
    assert (shape.qk_norm, shape.qkv_bias, shape.head_dim) == (True, False, 128)
    assert shape.rope_theta == 1e6
    assert parameters(shape) == 8_190_735_360
    tiny = ModelShape.from_tiny(TinyModel(architecture="qwen3"), vocab=128)
    assert (tiny.architecture, tiny.qk_norm, tiny.qkv_bias) == ("Qwen3ForCausalLM", True, False)


def test_unsupported_architectures_are_named_with_the_supported_ones():
    config = {**QWEN3_8B, "architectures": ["DeepseekV3ForCausalLM"]}
    with pytest.raises(ValueError, match=r"has none mtprun supports \(.*Qwen3ForCausalLM"):
        ModelShape.from_hf_config(config)


def test_validate_accepts_a_qwen3_folder_and_a_tiny_qwen3(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    recipe = RECIPES / "examples" / "qwen3-sft.yaml"
    for overrides in ([], [f"model.path={tmp_path}", "model.tiny=null"]):
        check = check_recipe(recipe, overrides)
        assert [str(d) for d in check.diagnostics] == []


def test_every_family_folder_is_registered_and_matches_its_registry_entry():
    # The registry (mtprun.spec.families) is the one list; each folder holds the rest.
    folders = {path.parent.name for path in (Path(families.__file__).parent).glob("*/__init__.py")}
    assert folders == {entry.name for entry in FAMILY_REGISTRY}
    for entry, unit in zip(FAMILY_REGISTRY, FAMILY_UNITS, strict=True):
        assert isinstance(unit, FamilyUnit) and entry.name == unit.NAME
        tiny = [f for f in unit.FAMILIES if f.tiny]
        if entry.tiny is None:
            assert tiny == []
            continue
        assert [f.tiny for f in tiny] == [entry.name] and tiny[0] is unit.FAMILIES[0]
        assert entry.tiny.experts == (tiny[0].experts is not None)
        assert entry.tiny.mtp == tiny[0].mtp
        assert (tiny[0].tiny_mtp_tensors is not None) == tiny[0].mtp


def test_family_descriptors_import_no_torch():
    # `mtprun validate` reads shapes through the families: their folders' __init__ modules
    # (and what they import) stay free of torch; torch code sits in submodules.
    code = (
        "import sys; import mtprun.models.families as f; import mtprun.models.shape; "
        "assert len(f.FAMILIES) == 8; "
        "assert not {'torch', 'transformers', 'vllm'} & set(sys.modules), 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
