"""GRPO end to end through the `mtprun` console script (real Ray, vLLM, Megatron-core, MLflow)
rewarded by reward models the run serves itself, one run for both kinds: a tiny random-init
sequence classifier and a tiny random-init judge whose replies a regex reads, beside the
arithmetic rule reward (task.rewards, each logged as reward/<name>). Most of a random judge's
replies hold no digit: they count in reward/errors, score reward_on_error, and the run goes
on."""

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
        # the trainer, the rollout engine, the classifier and the judge: an actor each
        "resources": {"num_cpus": 4},
    }


def test_served_reward_models_score_every_rollout_and_unreadable_replies_count(
    tmp_path_factory, tokenizer, tiny_qwen2_dir
) -> None:
    folder = tmp_path_factory.mktemp("rm_run")
    build_tiny_classifier(tokenizer, folder / "rm", seed=3)
    (folder / "judge.txt").write_text("Question: {question}\nAnswer: {completion}\nScore:")
    judge = {"model": str(tiny_qwen2_dir), "kind": "judge", "prompt": "judge.txt"}
    rewards = [
        {"reward": "arithmetic", "name": "correct"},
        {"model": "rm", "kind": "classifier", "weight": 0.1, "name": "rm"},
        {**judge, "parse": r"(\d)", "max_tokens": 8, "weight": 0.5, "name": "judge"},
    ]
    recipe = _recipe("e2e-reward-models", {"rewards": rewards, "reward_on_error": -1.0})
    with finished_run(write_recipe(folder, recipe), prefix="rm") as record:
        steps = list(range(1, STEPS + 1))
        keys = ("reward/rm", "reward/correct", "reward/mean", "reward/errors", "train/loss")
        for key in keys:
            assert record.steps(key) == steps, key
        # A random head's logits: finite, not all equal to the rule reward's 0/1.
        assert all(abs(v) < 100 for v in record.values("reward/rm"))
        # Only the judge can fail here: at most the step's 8 episodes, each scored -1 for it.
        assert all(0 <= e <= 8 for e in record.values("reward/errors"))
        assert min(record.values("reward/mean")) >= 0.5 * -1.0 + 0.1 * -100
