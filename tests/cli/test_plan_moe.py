"""`mtprun plan` of a mixture-of-experts recipe: its trunk terms (router losses, not head
terms), the experts per rank, sparse and dense layers, and the memory per rank."""

from __future__ import annotations

import json
from pathlib import Path

from mtprun.cli import main
from mtprun.compiler import HeadPlan, compile_recipe
from mtprun.losses.router import RouterAuxLossTerm
from mtprun.preflight import load_recipe
from mtprun.preflight.memory import GIB, TrainerMemory, recipe_trainer_memory

REPO = Path(__file__).resolve().parents[2]
TINY_MOE = REPO / "recipes" / "examples" / "qwen3-moe-tiny-grpo.yaml"

# Qwen3-30B-A3B's config.json (the fields the shape reads).
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
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


def _qwen3_30b(tmp_path: Path, **config) -> list[str]:
    """Overrides that put the tiny MoE recipe on a Qwen3-30B-A3B folder on 8 GPUs, dp 8 ep 8."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, **config}))
    return [
        "model.tiny=null",
        f"model.path={tmp_path}",
        "model.dtype=bfloat16",
        "warmstart=null",
        "parallel.dp=8",
        "parallel.ep=8",
        "trainer.micro_batch_tokens=8192",
        "trainer.recompute=full",
        "resources.num_cpus=16",
        "resources.num_gpus=9",
        "resources.gpu_memory_gib=80",
    ]


def _plan(capsys, *args: str) -> str:
    assert main(["plan", *map(str, args)]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_plan_lists_trunk_terms_after_the_head_terms(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the exchange row on one line  # one table row per line
    out = _plan(capsys, TINY_MOE, "losses.2={kind: router_z, weight: 0.0001}")
    _, line = RouterAuxLossTerm(weight=1e-3).describe()
    assert f"│ router_aux │ 0.001 │ {line} │" in out
    assert (
        "a trunk loss, added by megatron-core's router in every MoE layer; not a head term" in out
    )
    assert "│ router_z │ 0.0001 │ weight 0.0001: a trunk loss" in out
    # The head plan itself holds only the head term.
    assert [t.kind for t in compile_recipe(load_recipe(TINY_MOE)).terms] == ["grpo"]


def test_plan_shows_the_experts_per_rank_of_a_tiny_moe(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the exchange row on one line
    out = _plan(capsys, TINY_MOE)
    assert "mixture of experts" in out
    assert "experts │ 8 routed of width 64 a sparse layer, top 2 a token; no shared expert" in out
    assert "router │ softmax, top-k renormalised" in out
    assert "layers │ 2 sparse, 0 dense" in out
    assert "experts per rank │ 8 of 8 a sparse layer (parallel.ep 1: 8 / 1); 16 on a rank" in out
    assert "expert parameters per rank │ 0.39 M" in out  # 2 layers x 8 x 3 x 128 x 64
    assert "each expert lives on one rank (dp x cp / ep = 1): not summed" in out
    assert "token exchange │ none (parallel.ep 1): each token is copied to its 2 experts" in out
    assert "512 tokens x 2 layers (2 sparse) x 1 micro batch in flight" in out


def test_plan_shows_a_qwen3_30b_a3b_split_over_eight_expert_parallel_ranks(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the exchange row on one line
    overrides = _qwen3_30b(tmp_path)
    out = _plan(capsys, TINY_MOE, *overrides)
    memory = recipe_trainer_memory(load_recipe(TINY_MOE, overrides))
    assert isinstance(memory, TrainerMemory)
    gib = {name: f"{n / GIB:.2f}" for name, n in memory.parts().items()}
    assert "experts │ 128 routed of width 768 a sparse layer, top 8 a token" in out
    assert "layers │ 48 sparse, 0 dense" in out
    assert (
        "experts per rank │ 16 of 128 a sparse layer (parallel.ep 8: 128 / 8); 768 on a rank "
        "(48 sparse layers)" in out
    )
    assert "expert parameters per rank │ 3.62 B" in out  # 48 x 16 x 3 x 2048 x 768
    # 8 ranks of 16 experts, 8 experts a token: the ranks it reaches, 8 (1 - C(112, 8) /
    # C(128, 8)) = 5.34 (20,000 random draws: 5.342).
    assert (
        "token exchange │ all-to-all over the 8 expert-parallel ranks: each token sent once to "
        "each rank that holds any of its 8 experts (5.34 copies a token under uniform routing, "
        "where one per expert would be 8), then copied to its experts there; not overlapped "
        "with compute: each layer waits for its exchange and for the busiest rank's experts "
        "(train/moe/ep_load_max_over_mean)" in out
    )
    assert (
        f"weights │ {gib['weights']} │ bf16 compute weights; 16 experts of each sparse layer"
        in (out)
    )
    assert (
        f"optimizer state │ {gib['optimizer']} │ AdamW: float32 master weights, exp_avg, "
        "exp_avg_sq; sharded over dp x cp = 8 ranks, the experts' over dp x cp / ep = 1" in out
    )
    assert "8192 tokens x 48 layers (48 sparse) x 1 micro batch in flight" in out
    assert f"total │ {memory.total / GIB:.2f} │ fits resources.gpu_memory_gib 80" in out

    # Dense layers: mlp_only_layers and decoder_sparse_step; ep 4 leaves each expert on 2 ranks.
    overrides = [*_qwen3_30b(tmp_path, mlp_only_layers=[0, 1]), "parallel.ep=4"]
    out = _plan(capsys, TINY_MOE, *overrides)
    assert "layers │ 46 sparse, 2 dense (0, 1)" in out
    assert "32 of 128 a sparse layer (parallel.ep 4: 128 / 4); 1472 on a rank" in out
    assert "summed over the 2 ranks that hold the same experts (dp x cp / ep)" in out


def test_plan_json_carries_trunk_terms_and_the_experts(tmp_path, capsys) -> None:
    overrides = _qwen3_30b(tmp_path)
    assert main(["plan", str(TINY_MOE), *overrides, "--json"]) == 0
    printed = capsys.readouterr().out
    recipe = load_recipe(TINY_MOE, overrides)
    assert HeadPlan.from_json(printed) == compile_recipe(recipe)  # still round-trips
    data = json.loads(printed)
    assert data["trunk_terms"] == [
        {
            "kind": "router_aux",
            "weight": 0.001,
            "description": RouterAuxLossTerm(weight=1e-3).describe()[1],
        }
    ]
    assert data["experts"] == {
        "count": 128,
        "top_k": 8,
        "intermediate": 768,
        "shared_intermediate": 0,
        "router": "softmax, top-k renormalised",
        "ep": 8,
        "experts_per_rank": 16,
        "sparse_layers": 48,
        "dense_layers": [],
        "expert_data_parallel": 1,
        "sent_copies_per_token": 5.34,
        "rank_sparse_layers": 48,
        "rank_expert_params": 48 * 16 * 3 * 2048 * 768,
    }
    memory = data["trainer_memory"]
    assert memory == recipe_trainer_memory(recipe).to_dict()
    assert (memory["experts_per_rank"], memory["expert_optimizer_shards"]) == (16, 1)


def test_plan_json_of_a_dense_recipe_has_no_experts_and_no_trunk_terms(capsys) -> None:
    assert main(["plan", str(REPO / "recipes" / "quickstart.yaml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["experts"] is None and data["trunk_terms"] == []
    assert data["trainer_memory"]["experts_per_rank"] == 0
