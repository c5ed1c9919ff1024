"""`mtprun plan` of a LoRA recipe: its adapters, trainable parameters and the memory per rank
against full fine-tuning."""

from __future__ import annotations

import json

from mtprun.cli import main
from mtprun.preflight import load_recipe
from mtprun.preflight.memory import TrainerMemory, parameters, recipe_trainer_memory
from mtprun.preflight.model_shape import recipe_shape

RECIPE = """\
name: t
model:
  tiny: {hidden: 128, heads: 2, kv_heads: 1, layers: 2, intermediate: 256}
  lora: {rank: 8, targets: [qkv, fc2]}
data: {source: arithmetic, template: char}
"""


def _plan(capsys, *args: str) -> str:
    assert main(["plan", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_plan_shows_lora_against_full_fine_tuning(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    recipe = load_recipe(path)
    shape = recipe_shape(recipe)
    mine, full = recipe_trainer_memory(recipe), recipe_trainer_memory(recipe, full_finetune=True)
    assert isinstance(mine, TrainerMemory) and isinstance(full, TrainerMemory)
    # h 128, q 128, kv 64, f 256, r 8, 2 layers: qkv 3*8*128 + 8*(128 + 2*64); fc2 8*256 + 128*8
    trainable = 2 * ((3072 + 2048) + (2048 + 1024))
    assert mine.lora_params == trainable
    assert mine.gradients == trainable * 4 and full.gradients == parameters(shape) * 4

    data = json.loads(_plan(capsys, path, "--json"))
    assert data["lora"] == {
        "rank": 8,
        "alpha": 16.0,
        "scaling": 2.0,
        "dropout": 0.0,
        "modules": ["q_proj", "k_proj", "v_proj", "down_proj"],
        "trainable_params": trainable,
        "base_params": parameters(shape),
        "rank_trainable_params": trainable,
        "memory_per_rank": mine.total,
        "full_finetune_memory_per_rank": full.total,
    }
    assert data["trainer_memory"]["lora_params"] == trainable

    out = " ".join(_plan(capsys, path).split())
    assert "LoRA" in out
    assert (
        "adapters │ rank 8, alpha 16 (scaling 2), dropout 0 on q_proj, k_proj, v_proj, "
        "down_proj of every decoder layer" in out
    )
    share = f"{100 * trainable / parameters(shape):.3g}%"
    assert "trainable parameters │ 16.4 K of " in out and share in out
    saving = f"saves {(full.total - mine.total) / 2**20:.2f} MiB" in out
    assert saving
    assert "float32 gradients of the LoRA adapters" in out
    assert f"of the {trainable:,} adapter parameters only" in out

    # Without model.lora: no LoRA table, null in the JSON.
    data = json.loads(_plan(capsys, path, "model.lora=null", "--json"))
    assert data["lora"] is None and data["trainer_memory"]["lora_params"] == 0
