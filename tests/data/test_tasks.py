from __future__ import annotations

import random
import subprocess
import sys

import pytest

from mtprun.data.messages import Message, ToolCall
from mtprun.data.tasks import get_reward, get_task
from mtprun.data.tasks.calculator import calculator_trace, run_tool_call


@pytest.mark.parametrize("name", ["addition", "arithmetic", "calculator_tool"])
def test_prompts_are_seeded(name: str) -> None:
    task = get_task(name)
    seed = random.randrange(10_000)
    prompts = task.prompts(50, seed)
    assert prompts == task.prompts(50, seed)
    assert prompts != task.prompts(50, seed + 1)


def test_arithmetic_answers_are_correct() -> None:
    for prompt in get_task("arithmetic").prompts(50, random.randrange(10_000)):
        (question,) = prompt.messages
        expression = question.content.removesuffix("=")
        assert int(prompt.answer) == eval(expression)  # the reference, on trusted digits
        assert int(prompt.answer) >= 0
        assert all(0 <= int(x) <= 20 for x in expression.replace("-", "+").split("+"))


@pytest.mark.parametrize("name", ["arithmetic", "calculator_tool"])
def test_reward_is_one_for_the_expert_and_zero_for_a_wrong_answer(name: str) -> None:
    task, reward = get_task(name), get_reward(name)
    for prompt in task.prompts(10, random.randrange(10_000)):
        demonstration = task.demonstration(prompt)
        assert reward(demonstration, prompt) == 1.0
        wrong = (*demonstration[:-1], Message("assistant", str(int(prompt.answer) + 1)))
        assert reward(wrong, prompt) == 0.0
        assert reward(prompt.messages, prompt) == 0.0


def test_calculator_demonstration_is_call_long_output_answer() -> None:
    task = get_task("calculator_tool")
    prompt = task.prompts(1, random.randrange(10_000))[0]
    user, call, tool, answer = task.demonstration(prompt)
    assert [m.role for m in (user, call, tool, answer)] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert call.tool_calls[0].name == "calculator"
    assert tool.content.endswith(f"result: {prompt.answer}")
    assert len(tool.content) > 3 * (len(call.tool_calls[0].to_json()) + len(answer.content))
    assert task.environment().step((*prompt.messages, answer)).done


def test_calculator_trace_evaluates_integer_arithmetic() -> None:
    rng = random.Random()
    for _ in range(20):
        a, b, c = (rng.randint(-99, 99) for _ in range(3))
        expression = f"({a})*{b}-{c}+{a}"
        assert calculator_trace(expression).endswith(f"result: {a * b - c + a}")


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (ToolCall("search", {"q": "x"}), "unknown tool 'search'; the only tool is 'calculator'"),
        (ToolCall("calculator", {"expr": "1+1"}), 'takes {"expression"'),
        (ToolCall("calculator", {"expression": "1+"}), "error: cannot parse"),
        (ToolCall("calculator", {"expression": "2**8"}), "unsupported syntax '2 ** 8'"),
        (ToolCall("calculator", {"expression": "__import__('os')"}), "unsupported syntax"),
        (ToolCall("calculator", {"expression": "99999999*" * 5 + "9"}), "more than 30 digits"),
    ],
)
def test_bad_tool_calls_answer_with_readable_errors(call: ToolCall, error: str) -> None:
    assert error in run_tool_call(call)


def test_unknown_task_and_reward_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'chess'.*arithmetic.*calculator_tool"):
        get_task("chess")
    with pytest.raises(ValueError, match=r"unknown reward 'elo'.*arithmetic"):
        get_reward("elo")


def test_registries_import_without_torch() -> None:
    """Recipe validation reads the task/reward registries and the chat templates: they must
    not pull in torch or transformers (`mtprun validate` starts in well under a second)."""
    code = (
        "import sys, mtprun.data.tasks, mtprun.data.templates; "
        "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
