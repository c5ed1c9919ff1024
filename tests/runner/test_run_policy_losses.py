"""The grpo term's policy-loss options end to end (the console script, Ray, vLLM,
Megatron-core, MLflow): test_run_grpo's recipe with GSPO's sequence ratio, the dual clip,
old log-probs recomputed by the trainer with a truncated IS correction, Dr. GRPO's constant
length and DAPO's dynamic sampling."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from .cli_run import RunRecord, finish, start, write_recipe
from .test_run_grpo import WARMSTART_STEPS, grpo_recipe

pytestmark = pytest.mark.slow

GRPO_STEPS = 3
MAX_ROUNDS = 2


@pytest.fixture(scope="module")
def variant_run():
    root = Path(tempfile.mkdtemp(prefix="mtp", dir="/tmp"))  # short: Ray's sockets
    recipe = grpo_recipe(root / "run")
    recipe["losses"] = [
        {
            "kind": "grpo",
            "ratio": "sequence",
            "clip_c": 3.0,
            "tis_cap": 2.0,
            "loss_agg": "seq-mean-token-sum-norm",
            "kl_coef": 0.01,
        }
    ]
    recipe["rollout"]["recompute_logprobs"] = True
    recipe["task"].update(drop_uniform_groups=True, max_sampling_rounds=MAX_ROUNDS)
    recipe["trainer"].update(steps=GRPO_STEPS, checkpoint_every=GRPO_STEPS)
    try:
        code, out = finish(start(write_recipe(root, recipe), cwd=root))
        assert code == 0, out[-3000:]
        yield RunRecord(root / "run")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_every_grpo_step_reports_the_sampler_mismatch(variant_run):
    grpo_steps = list(range(WARMSTART_STEPS + 1, WARMSTART_STEPS + GRPO_STEPS + 1))
    for key in ("train/logprob_mismatch", "train/is_weight_mean", "train/is_clip_frac"):
        assert variant_run.steps(key) == grpo_steps, key
    # vLLM and the trainer run the same float32 weights: close, but not bit-equal, log-probs.
    mismatch = variant_run.values("train/logprob_mismatch")
    assert all(0 <= m < 0.05 for m in mismatch), mismatch
    assert variant_run.values("train/is_weight_mean") == pytest.approx([1.0] * GRPO_STEPS, abs=0.05)
    # The old log-probs are the trainer's own, just before the update: the update starts on
    # policy, every (sequence) ratio 1 and none clipped.
    assert variant_run.values("train/grpo/ratio_mean") == pytest.approx([1.0] * GRPO_STEPS)
    assert variant_run.values("train/grpo/clip_frac") == [0.0] * GRPO_STEPS


def test_dynamic_sampling_keeps_groups_whose_rewards_differ(variant_run):
    rounds = variant_run.values("rollout/sampling_rounds")
    dropped = variant_run.values("rollout/dropped_groups")
    stds = variant_run.values("reward/std")
    assert all(1 <= r <= MAX_ROUNDS for r in rounds), rounds
    for r, d, std in zip(rounds, dropped, stds, strict=True):
        if r == 1:
            assert d == 0  # the first round filled the step
        if d == 0 or r < MAX_ROUNDS:
            assert std > 0  # only groups with a spread of rewards were trained
