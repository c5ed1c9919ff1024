"""recipes/grpo-agentic.yaml end to end: after its SFT warm start the tiny policy calls the
calculator in its rollouts, the episode collector answers each call as a tool turn and the
policy samples again after it, and the step trains on those multi-turn trajectories."""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_run import finished_run

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).parents[2] / "recipes" / "grpo-agentic.yaml"
RL_STEPS = 2


@pytest.fixture(scope="module")
def agentic_run():
    with finished_run(RECIPE, f"trainer.steps={RL_STEPS}", prefix="agt") as record:
        yield record


def test_rollouts_call_the_tool_and_continue_after_its_answer(agentic_run):
    # rollout/tool_turns counts the tool answers inserted with a turn left after them
    # (max_turns 2): each one was followed by another sampled policy turn.
    tool_turns = agentic_run.values("rollout/tool_turns")
    assert len(tool_turns) == RL_STEPS
    assert max(tool_turns) > 0, tool_turns


def test_the_multi_turn_trajectories_train(agentic_run):
    trained = agentic_run.values("train/trained_tokens")
    assert len(trained) > RL_STEPS and all(t > 0 for t in trained[-RL_STEPS:])
    fractions = agentic_run.values("train/trained_token_frac")[-RL_STEPS:]
    assert all(0.0 < f < 1.0 for f in fractions)  # prompts and tool answers never train
