from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from mtprun.data.messages import Message, ToolCall
from mtprun.data.rewards import load_reward
from mtprun.data.tasks import get_task
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
def test_reward_is_one_for_the_expert_and_zero_for_a_wrong_answer(name: str, reward_of) -> None:
    task, reward = get_task(name), reward_of(name)
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
        load_reward("elo")


def test_registries_import_without_torch() -> None:
    """Recipe validation reads the task/reward registries and the chat templates: they must
    not pull in torch or transformers (`mtprun validate` starts in well under a second)."""
    code = (
        "import sys, mtprun.data.tasks, mtprun.data.rewards, mtprun.data.templates; "
        "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("name", ["arithmetic", "prompts.parquet"])
def test_each_dynamic_sampling_round_draws_prompts_of_its_own(name: str, tmp_path) -> None:
    from mtprun.data.tasks import task_for
    from mtprun.spec.data import TaskSection

    examples = Path(__file__).parents[2] / "recipes" / "examples"
    columns = {"prompt": "question", "answer": "solution"}
    dataset = {"path": str(examples / name), "columns": columns}
    source = {"name": name} if name == "arithmetic" else {"prompts": dataset}
    task = task_for(TaskSection(**source, reward="exact_answer"), 0, tmp_path)
    seed, step = random.randrange(10_000), random.randint(1, 50)
    first, extra = task.step_prompts(16, seed, step), task.step_prompts(16, seed, step, 1)
    assert first == task.step_prompts(16, seed, step)  # a resumed step sees what it saw
    assert extra == task.step_prompts(16, seed, step, 1)
    assert extra != first and extra != task.step_prompts(16, seed, step, 2)
