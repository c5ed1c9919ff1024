"""Built-in RL tasks by the names recipes use, and dataset tasks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mtprun.data.messages import Prompt
from mtprun.data.tasks.addition import AdditionTask
from mtprun.data.tasks.arithmetic import ArithmeticTask
from mtprun.data.tasks.base import Task
from mtprun.data.tasks.calculator import CalculatorToolTask
from mtprun.data.tasks.search import SearchTask

if TYPE_CHECKING:
    from mtprun.spec.data import TaskSection

TASKS: dict[str, type[Task]] = {
    AdditionTask.name: AdditionTask,
    ArithmeticTask.name: ArithmeticTask,
    CalculatorToolTask.name: CalculatorToolTask,
    SearchTask.name: SearchTask,  # built from task.prompts and task.search (task_for)
}


def get_task(name: str) -> Task:
    """The built-in task called `name` (a recipe's task.name, or a synthetic data.source), or
    the dataset of prompts at path `name`."""
    if name == SearchTask.name:
        raise ValueError(
            "the search task reads its prompts and corpus from a recipe's task section "
            "(task.prompts, task.search): it is no synthetic data source"
        )
    if name in TASKS:
        return TASKS[name]()
    from mtprun.data.dataset_files import SUFFIXES

    if name.endswith(SUFFIXES) or Path(name).is_dir():
        return _dataset_task(name, seed=0)
    raise ValueError(
        f"unknown task {name!r}: built-in tasks are {sorted(TASKS)}, or give a dataset file "
        f"({', '.join(SUFFIXES)}) or folder"
    )


def task_for(section: TaskSection, seed: int, cache_dir: str | Path | None = None) -> Task:
    """The task a recipe's `task:` section declares: its task source's (`task.type`, see
    mtprun/sources/tasks/)."""
    from mtprun.spec.sources import task_source

    return task_source(section).task(section, seed, cache_dir)


def _dataset_task(path: str, seed: int, cache_dir: str | Path | None = None) -> Task:
    from mtprun.data.tasks.dataset_prompts import DatasetPromptTask
    from mtprun.spec.data import DatasetSpec

    return DatasetPromptTask(DatasetSpec(path=path), seed, cache_dir)


__all__ = ["TASKS", "Prompt", "Task", "get_task", "task_for"]


def load_environment_class(reference: str) -> type:
    """The environment class a recipe's task.environment names (`verifiers:<module>`: the
    episode class of that verifiers taskset); ValueError (with the reason) when it cannot be
    imported or lacks the interface."""
    from mtprun.data.environment import interface_problem
    from mtprun.data.references import load_reference
    from mtprun.data.tasks.verifiers_env import is_verifiers_environment, load_verifiers_taskset

    if is_verifiers_environment(reference):
        return load_verifiers_taskset(reference).environment_class()

    cls = load_reference(reference)
    problem = interface_problem(cls)
    if problem is not None:
        raise ValueError(problem)
    return cls
