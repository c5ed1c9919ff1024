"""GRPO end to end through the `mtprun` console script (real Ray, vLLM, Megatron-core, MLflow)
rewarded by reward models the run serves itself: a tiny random-init sequence classifier beside
the arithmetic rule reward (task.rewards, each logged as reward/<name>), and a tiny random-init
judge whose replies a regex reads (most of a random model's replies hold no digit: they count
in reward/errors, and the run goes on)."""

from __future__ import annotations

import pytest

from .cli_run import E2E_TINY, finished_run, write_recipe
from .reward_model_folders import build_tiny_classifier

pytestmark = pytest.mark.slow

STEPS = 2


def _recipe(name: str, task: dict) -> dict:
    return {
        "name": name,
        "model": {"tiny": E2E_TINY},
        "task": {
            "name": "arithmetic",
            "template": "chatml",
            "samples_per_prompt": 4,
            "prompts_per_step": 2,
            "reward_timeout_s": 300,
            **task,
        },
        "losses": [{"kind": "grpo"}],
        "rollout": {"max_tokens": 6},
        "trainer": {"lr": 1e-4, "steps": STEPS, "micro_batch_tokens": 512},
        "resources": {"num_cpus": 3},  # the trainer, the rollout engine, the reward model
    }


def test_a_served_classifier_scores_every_rollout(tmp_path_factory, tokenizer) -> None:
    folder = tmp_path_factory.mktemp("rm_run")
    build_tiny_classifier(tokenizer, folder / "rm", seed=3)
    rewards = [
        {"reward": "arithmetic", "name": "correct"},
        {"model": "rm", "kind": "classifier", "weight": 0.1, "name": "rm"},
    ]
    path = write_recipe(folder, _recipe("e2e-reward-model", {"rewards": rewards}))
    with finished_run(path, prefix="rm") as record:
        steps = list(range(1, STEPS + 1))
        for key in ("reward/rm", "reward/correct", "reward/mean", "train/loss"):
            assert record.steps(key) == steps, key
        assert record.values("reward/errors") == [0.0] * STEPS
        # A random head's logits: finite, not all equal to the rule reward's 0/1.
        assert all(abs(v) < 100 for v in record.values("reward/rm"))


def test_a_served_judge_run_counts_unreadable_replies(tmp_path_factory, tiny_qwen2_dir) -> None:
    folder = tmp_path_factory.mktemp("judge_run")
    (folder / "judge.txt").write_text("Question: {question}\nAnswer: {completion}\nScore:")
    judge = {
        "model": str(tiny_qwen2_dir),
        "kind": "judge",
        "prompt": "judge.txt",
        "parse": r"(\d)",
        "max_tokens": 8,
    }
    recipe = _recipe("e2e-judge", {"reward": judge, "reward_on_error": -1.0})
    with finished_run(write_recipe(folder, recipe), prefix="judge") as record:
        steps = list(range(1, STEPS + 1))
        for key in ("reward/mean", "reward/errors", "train/loss"):
            assert record.steps(key) == steps, key
        errors = record.values("reward/errors")
        assert all(0 <= e <= 8 for e in errors)  # 8 episodes a step
        assert min(record.values("reward/mean")) >= -1.0  # an error scores reward_on_error
