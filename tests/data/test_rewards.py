"""The reward calling convention in-process: arguments by name, sync or async, floats or
components with a total, every malformed result refused with the reason; the built-ins."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mtprun.data.messages import Message, ToolCall
from mtprun.data.rewards import REWARDS, RewardInput, RewardValueError, call_reward, load_reward
from mtprun.data.tasks import Prompt

PROMPT = Prompt((Message("user", "What is 1/2 + 1/4?"),), "3/4", {"q": "1/2+1/4", "level": 3})


def _episode(*replies: Message) -> RewardInput:
    return RewardInput.of(PROMPT, (*PROMPT.messages, *replies))


def test_only_the_named_arguments_are_passed() -> None:
    seen = {}

    def reward(completion, answer):
        seen.update(completion=completion, answer=answer)
        return 1

    def everything(**kwargs):
        seen["all"] = kwargs
        return 0.5

    episode = _episode(Message("assistant", " 3/4 "))
    assert call_reward(reward, episode) == {"total": 1.0}
    assert seen == {"completion": " 3/4 ", "answer": "3/4"}
    assert call_reward(everything, episode) == {"total": 0.5}
    assert seen["all"]["prompt"] == {"q": "1/2+1/4", "level": 3}
    assert seen["all"]["messages"][-1] == {"role": "assistant", "content": " 3/4 "}


def test_a_tool_call_is_no_completion_and_async_rewards_are_awaited() -> None:
    call = Message("assistant", "let me compute", (ToolCall("calc", {"x": "1/2+1/4"}),))

    async def reward(completion, messages):
        return {"total": len(completion), "turns": len(messages)}

    assert call_reward(reward, _episode(call)) == {"total": 0.0, "turns": 2.0}


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        (math.nan, "the reward is nan (not finite)"),
        (np.float64(math.inf), "the reward is inf (not finite)"),
        ("1", "the reward is a str ('1')"),
        (None, "the reward is a NoneType"),
        ({"correct": 1.0}, "returned a mapping without 'total' (keys: correct)"),
        ({"total": 1.0, "x": math.nan}, "component 'x' is nan (not finite)"),
        ({"total": 1.0, "mean": 1.0}, "component name(s) ['mean'] are reserved"),
        ({"total": 1.0, "pass@1": 1.0}, "component name 'pass@1' is not a metric name"),
    ],
)
def test_malformed_results_are_refused_with_the_reason(result, reason) -> None:
    with pytest.raises(RewardValueError) as info:
        call_reward(lambda completion: result, _episode(Message("assistant", "x")))
    assert reason in str(info.value)


def test_numpy_and_bool_results_are_numbers() -> None:
    assert call_reward(lambda: np.float32(0.25), _episode()) == {"total": 0.25}
    assert call_reward(lambda: True, _episode()) == {"total": 1.0}


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The sum is $\\frac{3}{4}$.", "3/4", 1.0),
        ("\\boxed{0.75}", "3/4", 1.0),
        ("3/5", "3/4", 0.0),
        ("nothing here", "3/4", 0.0),
        ("19", "19", 1.0),
        ("anything", None, 0.0),
    ],
)
def test_the_math_reward_checks_equivalence_with_math_verify(completion, answer, expected):
    prompt = Prompt(PROMPT.messages, answer)
    episode = RewardInput.of(prompt, (*prompt.messages, Message("assistant", completion)))
    assert call_reward(load_reward("math"), episode) == {"total": expected}


def test_the_synthetic_tasks_name_the_exact_answer_reward() -> None:
    assert {REWARDS[n] for n in ("addition", "arithmetic", "calculator_tool")} == {
        REWARDS["exact_answer"]
    }


THOUGHT = Message("assistant", "3/4", reasoning_content="1/2 is 2/4, plus 1/4.")


def test_a_reward_gets_the_answer_without_reasoning_and_the_full_text_by_name() -> None:
    seen = {}

    def old_style(completion, answer):  # written before reasoning existed: still works
        seen["old"] = completion
        return 1.0

    def full(completion, reasoning, raw_completion):
        seen["full"] = (completion, reasoning, raw_completion)
        return 0.0

    raw = "<think>\n1/2 is 2/4, plus 1/4.\n</think>\n\n3/4"
    episode = RewardInput.of(PROMPT, (*PROMPT.messages, THOUGHT), raw_completion=raw)
    assert call_reward(old_style, episode) == {"total": 1.0}
    assert call_reward(full, episode) == {"total": 0.0}
    assert seen == {"old": "3/4", "full": ("3/4", "1/2 is 2/4, plus 1/4.", raw)}
    assert call_reward(load_reward("math"), episode) == {"total": 1.0}  # the thought ignored
    assert call_reward(lambda **kwargs: len(kwargs), episode) == {"total": 6.0}


def test_without_the_generated_text_the_full_text_is_rebuilt_from_the_message() -> None:
    assert _episode(THOUGHT).raw_completion == "<think>\n1/2 is 2/4, plus 1/4.\n</think>\n\n3/4"
    plain = _episode(Message("assistant", "3/4"))
    assert (plain.completion, plain.reasoning, plain.raw_completion) == ("3/4", "", "3/4")
    nothing = RewardInput.of(PROMPT, PROMPT.messages)
    assert (nothing.completion, nothing.reasoning, nothing.raw_completion) == ("", "", "")


def test_a_reward_file_may_declare_the_new_arguments(tmp_path) -> None:
    path = tmp_path / "mine.py"
    path.write_text(
        "def score(completion, raw_completion, reasoning=''):\n"
        "    return float('</think>' in raw_completion and '</think>' not in completion)\n"
        "def wrong(full_text):\n"
        "    return 0.0\n"
    )
    episode = RewardInput.of(PROMPT, (*PROMPT.messages, THOUGHT), "<think>x</think>3/4")
    assert call_reward(load_reward(f"{path}:score"), episode) == {"total": 1.0}
    with pytest.raises(
        ValueError,
        match=r"takes 'full_text', which mtprun does not pass.*reasoning, raw_completion by name",
    ):
        load_reward(f"{path}:wrong")
