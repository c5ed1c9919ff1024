"""trainer.router_replay: refused at the value without rollouts or without experts."""

from __future__ import annotations

TINY = "name: t\nmodel:\n  tiny:\n    hidden: 128\n    heads: 2\n    kv_heads: 1\n"  # 6 lines
MOE = TINY + "    architecture: qwen3_moe\n    experts: {count: 4, top_k: 2, intermediate: 32}\n"
TASK = "task: {name: arithmetic, reward: arithmetic}\nlosses: [{kind: grpo}]\n"
REPLAY = "trainer:\n  router_replay: true\n"


def test_router_replay_needs_a_task(write_recipe, located) -> None:
    path = write_recipe(MOE + "data: {source: arithmetic}\n" + REPLAY)  # replay on line 11
    assert located(path) == [
        f"{path}:11:18: router_replay routes rollout tokens to the experts the rollout engine "
        "chose, and this recipe has no task (no rollouts): remove it or add a task section"
    ]


def test_router_replay_needs_experts(write_recipe, located) -> None:
    path = write_recipe(TINY + TASK + REPLAY)  # replay on line 10
    assert located(path) == [
        f"{path}:10:18: router_replay replays the routing of a mixture-of-experts model, and the "
        "policy is dense (no experts): remove it or train an MoE model"
    ]


def test_router_replay_validates_for_rl_on_experts(write_recipe, located) -> None:
    path = write_recipe(MOE + TASK + REPLAY)
    assert located(path) == []
