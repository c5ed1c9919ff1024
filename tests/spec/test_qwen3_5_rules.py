"""Validate's rules for Qwen3.5 folders: a layer kind mtprun does not build, tp against the GDN
heads, LoRA, and more than one MTP layer, each reported at the recipe value with the reason
(exit 2); context parallelism passes with Gated DeltaNet layers (they hand their conv window
and state between ranks)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from mtprun.cli import main
from mtprun.preflight import check_recipe

from .test_shipped_recipes import QWEN3_5_9B, RECIPES

RECIPE = RECIPES / "examples" / "qwen3.5-9b-dapo-mtp.yaml"


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _errors(folder: Path, *overrides: str) -> list[str]:
    check = check_recipe(RECIPE, [f"model.path={folder}", *overrides])
    return [str(d) for d in check.diagnostics]


def test_an_unknown_layer_kind_exits_2_at_model_path(tmp_path, capsys):
    config = copy.deepcopy(QWEN3_5_9B)
    config["text_config"]["layer_types"][5] = "sliding_attention"
    folder = _folder(tmp_path, config)
    (error,) = _errors(folder)
    assert error.startswith("<override 1>")  # reported at the model.path value given
    assert "layer_types names 'sliding_attention', a layer kind mtprun does not build" in error
    assert main(["validate", str(RECIPE), f"model.path={folder}"]) == 2
    assert "sliding_attention" in capsys.readouterr().err


def test_context_parallelism_passes_with_gated_deltanet_layers(tmp_path):
    folder = _folder(tmp_path, QWEN3_5_9B)
    grpo = "losses=[{kind: grpo, clip_low: 0.2, clip_high: 0.28, loss_agg: token-mean}]"
    assert _errors(folder, "parallel.cp=2", "parallel.tp=2", grpo) == []
    # With the recipe's mtp term, that term is what cp refuses (its rows cross ranks).
    (error,) = _errors(folder, "parallel.cp=2", "parallel.tp=2")
    assert "an mtp term needs parallel.cp: 1" in error and "<override" not in error


def test_tp_must_split_the_gdn_heads(tmp_path):
    config = copy.deepcopy(QWEN3_5_9B)
    config["text_config"]["linear_num_key_heads"] = 6
    config["text_config"]["linear_num_value_heads"] = 12
    (error,) = _errors(_folder(tmp_path, config))
    assert "tp 4 does not divide the Gated DeltaNet's 6 key heads (linear_num_key_heads)" in error


def test_lora_is_refused_on_the_hybrid_model(tmp_path):
    lora = "model.lora={rank: 8, targets: [qkv]}"
    errors = _errors(_folder(tmp_path, QWEN3_5_9B), lora)
    assert any("LoRA on a hybrid model" in e for e in errors), errors


def test_more_than_one_qwen3_5_mtp_layer_is_refused(tmp_path):
    config = copy.deepcopy(QWEN3_5_9B)
    config["text_config"]["mtp_num_hidden_layers"] = 2
    (error,) = _errors(_folder(tmp_path, config))
    assert error.startswith("<override 1>")
    assert "2 Qwen3.5 MTP layers" in error and "use 1" in error
