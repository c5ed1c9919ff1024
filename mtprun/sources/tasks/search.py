"""Search-R1: `task.name: search` with `task.prompts` ({question, answers} rows) and
`task.search` (BM25 over a corpus, or a retrieval endpoint); its environment scores every
episode (exact match).

Fulfils mtprun.spec.sources.TaskSource: `name: search` or a `search:` section is this source;
preflight finds its prompts and its corpus; its factory is mtprun.data.tasks.search.SearchTask.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtprun.spec.data import TaskSection
    from mtprun.spec.sources import Problems

NAME = "search"


def infer(data: dict[str, Any]) -> bool:
    return data.get("name") == NAME or data.get("search") is not None


def default_reward(task: TaskSection) -> str | None:
    return None


def check(task: TaskSection) -> Problems:
    from mtprun.spec.sources import prompt_source

    if task.prompts is not None:
        for path, *problem in prompt_source(task.prompts).check(task.prompts):
            yield ("prompts", *path), *problem
    corpus = task.search.corpus if task.search is not None else None
    if corpus is not None and not os.path.isfile(corpus):
        yield ("search", "corpus"), f"file not found: {corpus}"


def task(task: TaskSection, seed: int, cache_dir: Any) -> Any:
    from mtprun.data.tasks.search import SearchTask
    from mtprun.sources.prompts.dataset import DatasetSpec

    if not isinstance(task.prompts, DatasetSpec) or task.search is None:
        raise ValueError("the search task needs task.prompts (a dataset) and task.search")
    return SearchTask(task.prompts, task.search, seed, cache_dir)
