"""model.lora: the recipe section, its rules at the value, and the memory estimate (a frozen
base: no gradients or optimizer state but the adapters')."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mtprun.preflight.memory import estimate_trainer_memory, lora_layer_params
from mtprun.spec.model import LoRASection
from mtprun.spec.parallel import ParallelSection

from .test_memory import PARAMS, SMALL, TOKENS

TINY = "name: t\nmodel:\n  tiny:\n    hidden: 128\n    heads: 2\n    kv_heads: 1\n"  # 6 lines
MOE = TINY + "    architecture: qwen3_moe\n    experts: {count: 4, top_k: 2, intermediate: 32}\n"
SFT = "data: {source: arithmetic}\n"


def test_lora_section_defaults_and_targets() -> None:
    lora = LoRASection()
    assert (lora.rank, lora.scaling, lora.dropout) == (16, 2.0, 0.0)
    assert lora.layers == ("qkv", "proj", "fc1", "fc2")
    assert lora.modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    )  # fmt: skip
    lora = LoRASection(rank=8, alpha=4, targets=["fc2", "qkv"])
    assert (lora.scaling, lora.layers) == (0.5, ("qkv", "fc2"))
    for bad in ({"rank": 0}, {"targets": []}, {"targets": ["q_proj"]}, {"dropout": 1.0}):
        with pytest.raises(ValidationError):
            LoRASection(**bad)


def test_lora_validates(write_recipe, located) -> None:
    path = write_recipe(TINY + "  lora: {rank: 8, targets: [qkv, fc1]}\n" + SFT)
    assert located(path) == []


def test_lora_rank_must_be_positive(write_recipe, located) -> None:
    path = write_recipe(TINY + "  lora:\n    rank: 0\n" + SFT)  # rank on line 8
    (message,) = located(path)
    assert message.startswith(f"{path}:8:11: ")
    assert "greater than or equal to 1" in message


def test_lora_path_is_refused_for_now(write_recipe, located) -> None:
    path = write_recipe(TINY + "  lora:\n    path: adapter\n" + SFT)  # path on line 8
    assert located(path) == [
        f"{path}:8:11: resuming from a PEFT adapter folder is not supported yet (issue 25): "
        "remove model.lora.path to start from fresh adapters (B = 0: the base model's outputs)"
    ]


def test_lora_on_moe_experts_is_refused_for_now(write_recipe, located) -> None:
    path = write_recipe(MOE + "  lora:\n    targets: [qkv, fc2]\n" + SFT)  # targets on line 10
    assert located(path) == [
        f"{path}:10:20: LoRA on a mixture-of-experts model's MLP (fc2: its experts) is not "
        "supported yet: use targets: [qkv, proj] (adapters on attention only)"
    ]
    path = write_recipe(MOE + "  lora: {}\n" + SFT)  # targets: all, by default
    (message,) = located(path)
    assert message.startswith(f"{path}:9:9: LoRA on a mixture-of-experts model's MLP (fc1, fc2")
    path = write_recipe(MOE + "  lora:\n    targets: [qkv, proj]\n" + SFT)
    assert located(path) == []


def test_lora_refuses_terms_of_frozen_layers(write_recipe, located) -> None:
    mimo = TINY + "    architecture: mimo\n    mtp_layers: 1\n  lora: {}\n"  # 9 lines
    path = write_recipe(mimo + SFT + "losses: [{kind: ce}, {kind: mtp}]\n")  # losses on 11
    assert located(path) == [
        f"{path}:11:29: the mtp term trains the MTP layers, which model.lora leaves frozen "
        "(adapters go on the decoder's layers only): remove the term or model.lora"
    ]


def test_schema_json_documents_lora() -> None:
    from pathlib import Path

    schema = json.loads((Path(__file__).parents[2] / "recipes" / "schema.json").read_text())
    lora = schema["$defs"]["LoRASection"]["properties"]
    assert set(lora) == {"rank", "alpha", "dropout", "targets", "path"}


# Adapters of SMALL (h 64, q 64, kv 32, f 128) at rank 8, by hand, tp = 1:
# qkv 3*8*64 + 8*(64 + 2*32); proj 8*64 + 64*8; fc1 2*8*64 + 2*128*8; fc2 8*128 + 64*8.
LORA_LAYER = (1536 + 1024) + 1024 + (1024 + 2048) + (1024 + 512)  # 8192
# tp = 2 (q 32, kv 16, f 64): A of q/k/v and fc1 whole, B split; proj/fc2 A split, B whole.
LORA_LAYER_TP2 = (1536 + 512) + (256 + 512) + (1024 + 1024) + (512 + 512)  # 5888


def test_lora_memory_counts_only_the_adapters_as_trained() -> None:
    lora = LoRASection(rank=8)
    assert lora_layer_params(SMALL, 1, lora) == LORA_LAYER
    assert lora_layer_params(SMALL, 2, lora) == LORA_LAYER_TP2
    assert lora_layer_params(SMALL, 1, LoRASection(rank=8, targets=["proj"])) == 1024

    def estimate(lora=None, **layout):
        return estimate_trainer_memory(
            SMALL, ParallelSection(**layout), dtype="float32", micro_batch_tokens=TOKENS, lora=lora
        )

    full, mine = estimate(), estimate(lora)
    adapters = 4 * LORA_LAYER
    assert mine.lora_params == adapters and full.lora_params == 0
    assert mine.weights == (PARAMS + adapters) * 4  # the frozen base and the adapters
    assert mine.gradients == adapters * 4  # float32 gradients of the adapters only
    assert mine.optimizer == adapters * 8  # AdamW's two float32 moments
    assert full.gradients == PARAMS * 4 and full.optimizer == PARAMS * 8
    # Activations: each of the 7 adapters keeps its float32 rank-8 product per token and layer.
    assert mine.activations - full.activations == TOKENS * 4 * 7 * 8 * 4
    assert mine.head_loss == full.head_loss
    assert mine.total < full.total
    assert estimate(lora, tp=2).lora_params == 4 * LORA_LAYER_TP2
    # bf16 weights: the distributed optimizer's float32 master copy and moments, over dp.
    bf16 = estimate_trainer_memory(
        SMALL, ParallelSection(dp=2), dtype="bfloat16", micro_batch_tokens=TOKENS, lora=lora
    )
    assert bf16.weights == (PARAMS + adapters) * 2
    assert bf16.gradients == adapters * 4
    assert bf16.optimizer == adapters * 12 // 2
