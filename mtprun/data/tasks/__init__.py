"""Built-in RL tasks and reward functions, by the names recipes use."""

from __future__ import annotations

from mtprun.data.tasks.addition import AdditionTask
from mtprun.data.tasks.arithmetic import ArithmeticTask
from mtprun.data.tasks.base import Prompt, RewardFn, Task, exact_answer_reward
from mtprun.data.tasks.calculator import CalculatorToolTask
from mtprun.data.tasks.jsonl_prompts import JsonlPromptTask

TASKS: dict[str, type[Task]] = {
    AdditionTask.name: AdditionTask,
    ArithmeticTask.name: ArithmeticTask,
    CalculatorToolTask.name: CalculatorToolTask,
}
# The built-in rewards all score the final answer; calculator_tool's prompts are hard enough
# to need the tool, so the reward needs no separate tool-use term.
REWARDS: dict[str, RewardFn] = {
    "addition": exact_answer_reward,
    "arithmetic": exact_answer_reward,
    "calculator_tool": exact_answer_reward,
    "exact_answer": exact_answer_reward,
}


def get_task(name: str) -> Task:
    """The task called `name` (the recipe's task.name, or a synthetic data.source): a
    built-in one, or a `.jsonl` file of prompts."""
    if name.endswith(".jsonl"):
        return JsonlPromptTask(name)
    try:
        return TASKS[name]()
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}: built-in tasks are {sorted(TASKS)}, or give a .jsonl "
            "file of prompts"
        ) from None


def get_reward(name: str) -> RewardFn:
    """The reward function called `name` (the recipe's task.reward)."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}: rewards are {sorted(REWARDS)}") from None


__all__ = ["REWARDS", "TASKS", "Prompt", "RewardFn", "Task", "get_reward", "get_task"]
