"""recipes/examples/glm4-moe-mtp-specdec.yaml (GLM-4.5: a sparse MTP layer, vLLM's
glm4_moe_mtp drafter) and recipes/examples/qwen3_5-tiny-grpo-mtp.yaml (Qwen3.5: Gated DeltaNet
layers, vLLM's qwen3_5_mtp drafter, served in bfloat16) end to end (MiMo's recipe,
recipes/mtp-specdec.yaml, runs the same code with a Qwen2 trunk; its drafter is checked in
test_rollout and its head's training in test_trainer):
the rollout engine drafts with the policy's MTP head, the decoupled `mtp` term trains that head
on the rollouts, and the draft acceptance rate that MLflow records rises from chance to most
drafts accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_run import finished_run

pytestmark = pytest.mark.slow

RECIPES = Path(__file__).parents[2] / "recipes"
# 4 RL steps of the recipes' 12 end the rise the test checks (2026-11-27; seeded, greedy: two
# GLM-4.5 runs gave the same rates): GLM-4.5's acceptance went 0.06, 0.17, 0.60, 0.75 (0.82,
# 0.73 at steps 5 and 6), Qwen3.5's 0.00, 0.28, 0.46, 0.73. Each step cut saves ~4 s a run.
RL_STEPS = 4


@pytest.fixture(
    scope="module",
    params=["examples/glm4-moe-mtp-specdec.yaml", "examples/qwen3_5-tiny-grpo-mtp.yaml"],
    ids=["glm4_moe", "qwen3_5"],
)
def specdec_run(request):
    recipe = RECIPES / request.param
    with finished_run(recipe, f"trainer.steps={RL_STEPS}", prefix="mtp") as record:
        yield record


def test_draft_acceptance_rises_over_training(specdec_run):
    accept = specdec_run.values("rollout/spec_accept_rate")
    warmstart = specdec_run.steps("train/loss")[0:-RL_STEPS]
    assert specdec_run.steps("rollout/spec_accept_rate") == [
        len(warmstart) + i for i in range(1, RL_STEPS + 1)
    ]
    # The head starts at its random init (the warm-start trains CE only): chance acceptance.
    assert accept[0] < 0.1, accept
    assert accept[-1] > 0.5, accept
    assert max(accept[:2]) < min(accept[-2:]), accept


def test_rollouts_and_the_draft_head_are_tracked(specdec_run):
    metrics = specdec_run.run.data.metrics
    for key in (
        "rollout/tokens_per_s",
        "rollout/spec_drafts",
        "rollout/spec_accept_rate/pos0",
        "rollout/spec_mean_accepted_len",
        "train/mtp/1/loss",
    ):
        assert key in metrics, sorted(metrics)
    # One draft token per step: acceptance at position 0 is the acceptance, and a step
    # yields the target's token plus the accepted draft.
    accept = specdec_run.values("rollout/spec_accept_rate")
    assert specdec_run.values("rollout/spec_accept_rate/pos0") == pytest.approx(accept)
    mean_len = specdec_run.values("rollout/spec_mean_accepted_len")
    assert mean_len == pytest.approx([1.0 + a for a in accept])
    assert metrics["rollout/spec_drafts"] > 0
    assert metrics["rollout/tokens_per_s"] > 0
    draft_loss = specdec_run.values("train/mtp/1/loss")
    assert draft_loss[-1] < draft_loss[0]
    # The separate optimizer reports the head's own gradient norm.
    assert specdec_run.values("train/mtp/grad_norm")[0] > 0
