"""A verifiers (>= 0.4) taskset: `task.environment: verifiers:<module>` (or
`verifiers:path/to/file.py`), whose tasks are the prompts and whose rewards score every
episode.

Fulfils mtprun.spec.sources.TaskSource: an environment naming a taskset is this source; the
environment rule imports the taskset (mtprun.preflight.rules); its factory is the taskset's
prompts (mtprun.data.tasks.verifiers_env).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtprun.spec.data import TaskSection
    from mtprun.spec.sources import Problems

NAME = "verifiers"
PREFIX = "verifiers:"


def infer(data: dict[str, Any]) -> bool:
    environment = data.get("environment")
    return isinstance(environment, str) and environment.startswith(PREFIX)


def default_reward(task: TaskSection) -> str | None:
    return None


def check(task: TaskSection) -> Problems:
    return iter(())  # task.environment's own rule loads the taskset


def task(task: TaskSection, seed: int, cache_dir: Any) -> Any:
    from mtprun.data.tasks.verifiers_env import VerifiersPromptTask

    return VerifiersPromptTask(task.environment)
