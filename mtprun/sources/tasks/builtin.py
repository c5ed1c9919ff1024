"""The built-in synthetic tasks: `task.name: arithmetic` (addition, calculator_tool, ...).

Fulfils mtprun.spec.sources.TaskSource: a name of `NAMES` (mtprun.data.tasks.TASKS holds their
classes) with no prompts is this source; it needs nothing outside the recipe; its factory is
the task class called without arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtprun.spec.data import TaskSection
    from mtprun.spec.sources import Problems

NAME = "builtin"
NAMES = ("addition", "arithmetic", "calculator_tool")
"""The built-in synthetic tasks (tests/data/test_tasks.py holds them to data.tasks.TASKS)."""


def infer(data: dict[str, Any]) -> bool:
    return data.get("name") in NAMES and data.get("prompts") is None


def default_reward(task: TaskSection) -> str | None:
    return None


def check(task: TaskSection) -> Problems:
    return iter(())


def task(task: TaskSection, seed: int, cache_dir: Any) -> Any:
    from mtprun.data.tasks import TASKS

    return TASKS[task.name]()
