"""The reward workers for real (spawned processes): parallel scoring, and each way a user
reward can go wrong answered as documented: raising, hanging past the timeout, NaN, a
dying process, each counted as an error and scored `reward_on_error`, or stopping the run
with the prompt, completion and traceback under `fail`."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from mtprun.data.messages import Message
from mtprun.data.tasks import Prompt
from mtprun.runner.rollout.rewards import EpisodeScorer, RewardFailed, component_means

REWARD_FILE = '''
import asyncio, math, os, time

def by_answer(completion, answer):
    """Misbehaves on purpose, chosen by the completion."""
    if completion == "raise":
        raise KeyError("no such key in the verifier")
    if completion == "hang":
        time.sleep(600)
    if completion == "nan":
        return math.nan
    if completion == "die":
        os._exit(3)
    if completion == "text":
        return "1.0"
    return {"correct": float(completion == answer), "length": len(completion),
            "total": float(completion == answer) + 0.5}

async def slow_async(completion, prompt):
    await asyncio.sleep(0.2)
    return float(prompt["level"]) + len(completion)

def thinking(completion, reasoning, raw_completion):
    return {"total": float(completion == "42"), "reasoned": float(reasoning == "6*7 is 42"),
            "raw_length": len(raw_completion)}
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    return path


def _episodes(completions: list[str]) -> tuple[list[Prompt], list[tuple[Message, ...]]]:
    prompt = Prompt((Message("user", "What is 6*7?"),), "42", {"question": "6*7", "level": 2})
    conversations = [(*prompt.messages, Message("assistant", c)) for c in completions]
    return [prompt] * len(completions), conversations


def test_components_and_errors_are_counted_and_errors_scored_on_error(reward_file) -> None:
    scorer = EpisodeScorer(f"{reward_file}:by_answer", workers=2, timeout_s=3, on_error=-1.0)
    try:
        completions = ["42", "raise", "hang", "nan", "die", "text", "41", "42"]
        scores = scorer.score(*_episodes(completions))
        assert scores.totals == [1.5, -1.0, -1.0, -1.0, -1.0, -1.0, 0.5, 1.5]
        errors = {c: o.error for c, o in zip(completions, scores.outcomes, strict=True)}
        assert "KeyError: 'no such key in the verifier'" in errors["raise"]
        assert "by_answer" in errors["raise"]  # the traceback names the user's frame
        assert "took longer than 3 s (task.reward_timeout_s)" in errors["hang"]
        assert "the reward is nan (not finite)" in errors["nan"]
        assert "process died (exit code 3)" in errors["die"]
        assert "the reward is a str ('1.0')" in errors["text"]
        assert component_means(scores.outcomes) == {"reward/correct": 2 / 3, "reward/length": 2.0}
        assert scores.errors == 5
        # The workers killed for the hang and the death were replaced: the pool still scores.
        again = scorer.score(*_episodes(["42", "0"]))
        assert again.totals == [1.5, 0.5] and again.errors == 0
    finally:
        scorer.close()


def test_fail_stops_with_the_prompt_completion_and_traceback(reward_file) -> None:
    scorer = EpisodeScorer(f"{reward_file}:by_answer", workers=1, timeout_s=5, on_error="fail")
    try:
        with pytest.raises(RewardFailed) as info:
            scorer.score(*_episodes(["42", "raise"]))
    finally:
        scorer.close()
    message = str(info.value)
    assert f"reward {reward_file}:by_answer failed on episode 1 (task.reward_on_error: fail)" in (
        message
    )
    assert "'question': '6*7'" in message  # the prompt record
    assert "user: What is 6*7?" in message
    assert "completion: 'raise'" in message
    assert "Traceback" in message and "KeyError" in message


def test_async_rewards_run_in_parallel_workers(reward_file) -> None:
    scorer = EpisodeScorer(f"{reward_file}:slow_async", workers=2, timeout_s=30, on_error="fail")
    try:
        scores = scorer.score(*_episodes(["a", "bb", "ccc", "dddd"]))
    finally:
        scorer.close()
    assert scores.totals == [3.0, 4.0, 5.0, 6.0]
    assert component_means(scores.outcomes) == {} and scores.errors == 0


def test_closing_stops_every_worker(reward_file) -> None:
    scorer = EpisodeScorer(f"{reward_file}:by_answer", workers=2, timeout_s=30, on_error=0.0)
    scorer.score(*_episodes(["42"]))
    pids = scorer.pool.pids
    scorer.close()
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_rewards_an_environment_gave_are_kept_and_the_rest_scored(reward_file) -> None:
    scorer = EpisodeScorer(f"{reward_file}:by_answer", workers=1, timeout_s=30, on_error=-1.0)
    try:
        given = [0.25, None, float("nan"), None]
        scores = scorer.score(*_episodes(["x", "42", "42", "raise"]), given=given)
    finally:
        scorer.close()
    assert scores.totals == [0.25, 1.5, -1.0, -1.0]
    assert "the environment's reward is nan (not finite)" in scores.outcomes[2].error
    # Components come from the episodes the reward function scored.
    assert component_means(scores.outcomes) == {"reward/correct": 1.0, "reward/length": 2.0}
    assert scores.errors == 2


def test_without_a_reward_an_episode_the_environment_did_not_reward_is_an_error() -> None:
    scorer = EpisodeScorer(None, workers=1, timeout_s=30, on_error=0.0)
    assert scorer.pool is None  # no worker processes to start
    scores = scorer.score(*_episodes(["42", "41"]), given=[1.0, None])
    assert scores.totals == [1.0, 0.0] and scores.errors == 1
    assert "no task.reward to score it" in scores.outcomes[1].error
    failing = EpisodeScorer(None, workers=1, timeout_s=30, on_error="fail")
    with pytest.raises(RewardFailed, match=r"reward of task\.environment failed on episode 1"):
        failing.score(*_episodes(["42", "41"]), given=[1.0, None])


def test_workers_pass_the_answer_without_reasoning_and_the_generated_text(reward_file) -> None:
    scorer = EpisodeScorer(f"{reward_file}:thinking", workers=1, timeout_s=30, on_error="fail")
    prompts, _ = _episodes(["42", "42"])
    reply = Message("assistant", "42", reasoning_content="6*7 is 42")
    conversations = [(*prompts[0].messages, reply)] * 2
    raw = "<think>\n6*7 is 42\n</think>\n\n42"
    try:
        scores = scorer.score(prompts, conversations, raw_completions=[raw, None])
    finally:
        scorer.close()
    # None: the text rebuilt from the final message (here the same text).
    expected = {"total": 1.0, "reasoned": 1.0, "raw_length": float(len(raw))}
    assert [o.components for o in scores.outcomes] == [expected, expected]


def test_a_worker_dying_before_it_loads_the_reward_fails_the_episodes_not_the_run(tmp_path) -> None:
    """A worker process that dies while starting (here the reward module exits at import; an
    unpicklable entry point does the same) is not started again and again: every episode is
    an error naming the start-up death, and the step ends."""
    path = tmp_path / "exits.py"
    path.write_text("import os\nos._exit(7)\n\ndef reward(completion):\n    return 1.0\n")
    scorer = EpisodeScorer(f"{path}:reward", workers=2, timeout_s=30, on_error=-1.0)
    try:
        scores = scorer.score(*_episodes(["42", "41", "40"]))
    finally:
        scorer.close()
    assert scores.totals == [-1.0, -1.0, -1.0] and scores.errors == 3
    assert all("died (exit code 7) while starting" in o.error for o in scores.outcomes)
