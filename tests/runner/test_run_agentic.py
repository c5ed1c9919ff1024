"""recipes/grpo-agentic.yaml end to end, its environment a user class given as
`path/to/file.py:Class` (tests/runner/envs/scored_calculator.py): after its SFT warm start the
tiny policy calls the calculator in its rollouts, the user environment answers each call as a
tool turn and scores every episode (the run has no task.reward), the policy samples again after
it, and the step trains on those multi-turn trajectories."""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_run import finished_run
from .envs.scored_calculator import REWARD_OFFSET

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).parents[2] / "recipes" / "grpo-agentic.yaml"
ENVIRONMENT = f"{Path(__file__).parent / 'envs' / 'scored_calculator.py'}:ScoredCalculator"
RL_STEPS = 2
# A shorter warm start at a higher learning rate than the recipe's (60 steps at 1e-3): 6 and 8 of
# the steps' 32 episodes called the tool after it, against 1 and 1 after the recipe's.
WARMSTART = ("warmstart.steps=45", "warmstart.lr=2e-3")


@pytest.fixture(scope="module")
def agentic_run():
    # No task.reward: the environment rewards every episode.
    overrides = (f"trainer.steps={RL_STEPS}", f"task.environment={ENVIRONMENT}", "task.reward=null")
    overrides += WARMSTART
    with finished_run(RECIPE, *overrides, prefix="agt") as record:
        yield record


def test_rollouts_call_the_tool_and_continue_after_its_answer(agentic_run):
    # rollout/tool_turns counts the environment's answers inserted with a turn left after
    # them (max_turns 2): each one was followed by another sampled policy turn.
    tool_turns = agentic_run.values("rollout/tool_turns")
    assert len(tool_turns) == RL_STEPS
    assert max(tool_turns) > 0, tool_turns


def test_the_user_environment_runs_and_scores_every_episode(agentic_run):
    # Every step of the user environment gives a reward (offset by REWARD_OFFSET); without
    # task.reward an episode it left unrewarded would be a reward error scored 0. So the
    # episodes ran in the user's environment, whose tool answers the tool turns above are.
    rewards = agentic_run.values("reward/mean")
    assert len(rewards) == RL_STEPS
    assert all(REWARD_OFFSET <= r <= REWARD_OFFSET + 1 for r in rewards), rewards
    assert agentic_run.values("reward/errors") == [0.0] * RL_STEPS


def test_the_multi_turn_trajectories_train(agentic_run):
    trained = agentic_run.values("train/trained_tokens")
    assert len(trained) > RL_STEPS and all(t > 0 for t in trained[-RL_STEPS:])
    fractions = agentic_run.values("train/trained_token_frac")[-RL_STEPS:]
    assert all(0.0 < f < 1.0 for f in fractions)  # prompts and tool answers never train
