"""model.lora: the recipe section, its rules at the value, and the memory estimate (a frozen
base: no gradients or optimizer state but the adapters')."""

from __future__ import annotations

import json
import shutil

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


# model.lora.path on line 9 (column 11) of this recipe; its rank 8 on line 8.
WITH_ADAPTER = TINY + "  lora:\n    rank: 8\n    path: adapter\n" + SFT


def _write_adapter(folder, lora=None, tiny=None, **config):
    """A PEFT adapter folder of `lora` (rank 8, every target) for the TINY model (or `tiny`),
    with `config` replacing adapter_config.json fields (None removes one)."""
    import numpy as np
    from safetensors.numpy import save_file

    from mtprun.models.peft_adapter import adapter_config, expected_tensors
    from mtprun.models.shape import ModelShape
    from mtprun.spec.model import TinyModel

    lora = lora or LoRASection(rank=8)
    tiny = tiny or TinyModel(hidden=128, heads=2, kv_heads=1)
    folder.mkdir(parents=True)
    fields = {**adapter_config(lora, "some/base"), **config}
    (folder / "adapter_config.json").write_text(
        json.dumps({k: v for k, v in fields.items() if v is not None})
    )
    shapes = expected_tensors(ModelShape.from_tiny(tiny, 128), lora)
    save_file(
        {n: np.zeros(s, np.float32) for n, s in shapes.items()},
        str(folder / "adapter_model.safetensors"),
    )
    return folder


def test_lora_path_takes_a_peft_adapter_folder_relative_to_the_recipe(
    write_recipe, located
) -> None:
    from mtprun.preflight import check_recipe

    path = write_recipe(WITH_ADAPTER)
    _write_adapter(path.parent / "adapter")
    assert located(path) == []
    assert check_recipe(path).recipe.model.lora.path == str(path.parent / "adapter")


def _at_path(path) -> str:
    return f"{path}:9:11: "


def test_lora_path_refuses_a_missing_or_foreign_folder(write_recipe, located) -> None:
    path = write_recipe(WITH_ADAPTER)
    folder = path.parent / "adapter"
    assert located(path) == [_at_path(path) + f"no adapter folder at {folder}"]
    folder.mkdir()
    assert located(path) == [
        _at_path(path) + f"{folder} is not a PEFT adapter folder: it has no "
        "adapter_config.json (a LoRA run's `mtprun export` writes one)"
    ]
    folder.rmdir()
    _write_adapter(folder).joinpath("adapter_model.safetensors").unlink()
    (message,) = located(path)
    assert message.startswith(_at_path(path) + f"{folder} has no adapter_model.safetensors")


CONFIG = "<config>"  # the adapter's adapter_config.json


@pytest.mark.parametrize(
    ("config", "complaint"),
    [
        (
            {"peft_type": "IA3"},
            f"{CONFIG}: peft_type is 'IA3': model.lora starts from LoRA adapters only",
        ),
        (
            {"use_dora": True},
            f"{CONFIG}: use_dora is True; mtprun's LoRA has no such adapters (it needs "
            "use_dora: false)",
        ),
        (
            {"r": 16},
            f"{CONFIG}: the adapter's rank r is 16 but model.lora.rank is 8: set "
            "model.lora.rank: 16",
        ),
        (
            {"lora_alpha": 32},
            f"{CONFIG}: the adapter's lora_alpha is 32 but model.lora.alpha is null (2 x rank): "
            "set model.lora.alpha: 32",
        ),
        (
            {"target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]},
            f"{CONFIG}: the adapter's target_modules are ['q_proj', 'k_proj', 'v_proj', "
            "'down_proj'] but model.lora.targets ['all'] adapt ['down_proj', 'gate_proj', "
            "'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']: set model.lora.targets: "
            "[qkv, fc2]",
        ),
        (
            {"target_modules": ["q_proj", "v_proj"]},
            f"{CONFIG}: the adapter's target_modules are ['q_proj', 'v_proj'] but "
            "model.lora.targets ['all'] adapt ['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
            "'q_proj', 'up_proj', 'v_proj'] (targets adapt whole layers: q_proj, k_proj and "
            "v_proj together, gate_proj and up_proj together, and there is no target for "
            "other modules)",
        ),
    ],
    ids=["not-lora", "dora", "rank", "alpha", "targets", "targets-unnamable"],
)
def test_lora_path_config_must_match_the_recipe(write_recipe, located, config, complaint) -> None:
    path = write_recipe(WITH_ADAPTER)
    folder = _write_adapter(path.parent / "adapter", **config)
    file = str(folder / "adapter_config.json")
    assert located(path) == [_at_path(path) + complaint.replace(CONFIG, file)]


def test_lora_path_adapter_of_another_base_model_is_refused(write_recipe, located) -> None:
    from mtprun.spec.model import TinyModel

    path = write_recipe(WITH_ADAPTER)
    folder = path.parent / "adapter"
    weights = folder / "adapter_model.safetensors"
    prefix = _at_path(path) + f"{weights}"
    # Its tensors say so: wider, or more layers.
    _write_adapter(folder, tiny=TinyModel(hidden=256, heads=4, kv_heads=2))
    assert located(path) == [
        f"{prefix}: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight is [8, 256] "
        "but the model needs [8, 128] ([r, in] for lora_A, [out, r] for lora_B): the adapter "
        "belongs to another base model"
    ]
    shutil.rmtree(folder)
    _write_adapter(folder, tiny=TinyModel(hidden=128, heads=2, kv_heads=1, layers=3))
    assert located(path) == [
        f"{prefix} has 14 tensor(s) the model has no place for, such as "
        "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight (the model has 2 layers; "
        "adapters of down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj): the "
        "adapter belongs to another base model"
    ]
    # Or the base model it records, a folder of another shape.
    shutil.rmtree(folder)
    base = path.parent / "base"
    base.mkdir()
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 128, "num_hidden_layers": 2}
    dims = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    (base / "config.json").write_text(json.dumps({**qwen2, **dims, "intermediate_size": 512}))
    _write_adapter(folder, base_model_name_or_path=str(base))
    assert located(path) == [
        _at_path(path) + f"{folder / 'adapter_config.json'}: the adapter was trained on {base}, "
        "whose intermediate is 512, but the model's is 256: the adapter belongs to another "
        "base model"
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
