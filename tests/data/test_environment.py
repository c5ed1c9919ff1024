"""The environment interface: reset/step, plain or async, its checks, and the rollout loop
(`expert_rollout`, the runner's loop with the scripted expert) driven by a user environment."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path

import pytest
import torch

from mtprun.data.environment import Environment, EnvStep, reset_all, step_all
from mtprun.data.messages import Message
from mtprun.data.render import ROLE_IDS, Renderer
from mtprun.data.tasks import get_task
from mtprun.data.trajectory import expert_rollout


class Tutor:
    """Asks the model to try again until it answers right, then rewards it by the number of
    turns it took; the first turn is always wrong in this test (see WrongFirst)."""

    def reset(self, prompt):
        self.answer = prompt.answer
        self.turns = 0
        return (Message("system", "Answer with a number."), *prompt.messages)

    async def step(self, messages):
        await asyncio.sleep(0)  # a real one would await a service here
        self.turns += 1
        if messages[-1].content == self.answer:
            return EnvStep(done=True, reward=1.0 / self.turns)
        return EnvStep([{"role": "user", "content": "No, try again."}], reward=0.0)


class Echo(Environment):
    def step(self, messages):
        return EnvStep([Message("tool", messages[-1].content)])


class WrongFirst:
    """A task whose expert answers wrong first, then right."""

    name = "wrong-first"

    def expert_reply(self, conversation, prompt):
        tried = any(m.content == "No, try again." for m in conversation)
        return Message("assistant", prompt.answer if tried else "?")  # never an answer


def test_plain_and_async_environments_step_together() -> None:
    prompts = get_task("arithmetic").prompts(4, seed=random.randrange(1000))
    envs = [Tutor(), Echo(), Tutor(), Echo()]
    starts = reset_all(envs, prompts)
    assert starts[0][0] == Message("system", "Answer with a number.")
    assert starts[1] == prompts[1].messages  # Environment's default reset
    replies = [(*s, Message("assistant", p.answer)) for s, p in zip(starts, prompts, strict=True)]
    results = step_all(envs, replies)
    assert [r.done for r in results] == [True, False, True, False]
    assert [r.reward for r in results] == [1.0, None, 1.0, None]
    assert results[1].messages == [Message("tool", prompts[1].answer)]


def test_a_user_environment_drives_the_rollout_loop(renderer: Renderer) -> None:
    prompt = get_task("arithmetic").prompts(1, seed=random.randrange(1000))[0]
    trajectory, conversation, reward = expert_rollout(
        WrongFirst(), prompt, renderer, max_turns=4, environment=Tutor
    )
    assert [m.role for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert conversation[-1].content == prompt.answer
    assert reward == 0.5  # right on the second turn
    # Exactly the rendering of the conversation, only the assistant's turns sampled.
    full = renderer.render(conversation)
    n = len(trajectory)
    assert torch.equal(trajectory.token_ids, full.token_ids[:n])
    assert torch.equal(trajectory.is_sampled, full.is_sampled[:n])
    retry = trajectory.roles == ROLE_IDS["user"]
    assert retry.any() and not trajectory.is_sampled[retry].any()


def test_the_last_turn_ends_the_episode_without_inserting(renderer: Renderer) -> None:
    prompt = get_task("arithmetic").prompts(1, seed=0)[0]
    trajectory, conversation, reward = expert_rollout(
        WrongFirst(), prompt, renderer, max_turns=1, environment=Tutor
    )
    assert [m.role for m in conversation] == ["system", "user", "assistant"]
    assert reward == 0.0 and trajectory.is_sampled[-1]


class Returns:
    def __init__(self, result=None, start=None):
        self.result, self.start = result, start

    def reset(self, prompt):
        return self.start

    def step(self, messages):
        return self.result


@pytest.mark.parametrize(
    ("result", "error"),
    [
        ({"done": True}, "Returns.step returned dict, not EnvStep"),
        (EnvStep(), "Returns.step returned done=False with 0 message(s)"),
        (EnvStep([Message("assistant", "x")]), "and no assistant message"),
        (EnvStep([{"role": "robot", "content": "x"}]), "unknown role 'robot'"),
        (EnvStep(done=True, reward="1"), "reward must be a number or None"),
    ],
)
def test_a_bad_step_is_a_clear_error(result, error: str) -> None:
    conversation = (Message("user", "q"), Message("assistant", "a"))
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        step_all([Returns(result)], [conversation])


@pytest.mark.parametrize(
    ("start", "error"),
    [
        ([], "Returns.reset returned no valid conversation: empty conversation"),
        ([Message("user", "q"), Message("assistant", "a")], "ending with an assistant message"),
    ],
)
def test_a_bad_reset_is_a_clear_error(start, error: str) -> None:
    prompt = get_task("arithmetic").prompts(1, seed=0)[0]
    with pytest.raises(ValueError, match=error):
        reset_all([Returns(start=start)], [prompt])


class WrongTimes:
    """A task whose expert answers wrong `wrong` times, then right."""

    name = "wrong-times"

    def __init__(self, wrong: int) -> None:
        self.wrong = wrong

    def expert_reply(self, conversation, prompt):
        tries = sum(m.role == "assistant" for m in conversation)
        return Message("assistant", "x" if tries < self.wrong else prompt.answer)


@pytest.mark.parametrize(("wrong", "reward"), [(0, 1.0), (1, 0.5), (2, 0.25), (3, 0.0)])
def test_the_example_environment_halves_the_reward_per_retry(
    renderer: Renderer, tmp_path, wrong: int, reward: float
) -> None:
    from mtprun.data.prompts import PromptDataset
    from mtprun.data.tasks import load_environment_class
    from mtprun.spec.data import ColumnMap, DatasetSpec

    examples = Path(__file__).parents[2] / "recipes" / "examples"
    try_again = load_environment_class(f"{examples / 'environments.py'}:TryAgain")
    columns = ColumnMap(prompt="question", answer="solution")
    data = PromptDataset(
        DatasetSpec(path=str(examples / "prompts.parquet"), columns=columns), 0, tmp_path
    )
    prompts = data.sample(40, seed=random.randrange(1000))
    carry = next(p for p in prompts if p.columns()["difficulty"] == "carry")
    _, conversation, got = expert_rollout(
        WrongTimes(wrong), carry, renderer, max_turns=3, environment=try_again
    )
    assert got == reward
    retries = [m.content for m in conversation if m.role == "user"][1:]
    assert retries == ["No. Mind the carry."] * min(wrong, 2)  # none after the last turn
