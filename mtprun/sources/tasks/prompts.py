"""A task whose prompts are a prompt source (`task.prompts`: a dataset, reasoning-gym, ...),
or, as older recipes write it, a dataset path in `task.name`.

Fulfils mtprun.spec.sources.TaskSource: a task with `prompts` (or a `name` that is no built-in
task) is this source; its check, factory and default reward are its prompt source's
(mtprun.spec.sources.PromptSource). A `name:` that is neither a built-in task nor a dataset
file's path is read as a dataset folder: a guess, noted as deprecated (write `prompts:`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtprun.spec.data import TaskSection
    from mtprun.spec.sources import Problems

NAME = "prompts"


def infer(data: dict[str, Any]) -> bool:
    return data.get("prompts") is not None or data.get("name") is not None


def default_reward(task: TaskSection) -> str | None:
    from mtprun.spec.sources import prompt_source

    if task.prompts is None:
        return None
    return prompt_source(task.prompts).default_reward(task.prompts)


def check(task: TaskSection) -> Problems:
    from mtprun.spec.sources import prompt_source

    if task.prompts is not None:
        for path, *problem in prompt_source(task.prompts).check(task.prompts):
            yield ("prompts", *path), *problem
    elif task.name is not None:
        yield from _name_check(task.name)


def _name_check(file: str) -> Problems:
    """`task.name: <dataset path>` (older recipes): the path exists, and a folder is noted."""
    from mtprun.data.tasks import TASKS
    from mtprun.sources.prompts.dataset import SUFFIXES, file_problem
    from mtprun.spec.errors import did_you_mean

    if not os.path.exists(file) and not file.endswith(SUFFIXES):
        name = os.path.basename(file)
        yield (
            ("name",),
            (
                f"unknown built-in task '{name}'{did_you_mean(name, TASKS)}; built-in: "
                f"{', '.join(TASKS)}; or a dataset file or folder (none at {file})"
            ),
        )
        return
    problem = file_problem(file)
    if problem is not None:
        yield ("name",), problem
    elif os.path.isdir(file):
        yield (
            ("name",),
            f"task.name {file} is read as a dataset folder (it names no built-in task): "
            f"deprecated, a guess from the name; write `prompts: {file}`",
            "warning",
        )


def task(task: TaskSection, seed: int, cache_dir: Any) -> Any:
    from mtprun.sources.prompts.dataset import DatasetSpec
    from mtprun.spec.sources import prompt_source

    prompts = task.prompts if task.prompts is not None else DatasetSpec(path=task.name)
    return prompt_source(prompts).task(prompts, seed, cache_dir)
