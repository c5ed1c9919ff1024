"""A task whose prompts (and reference answers) come from a dataset file or folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mtprun.data.messages import Prompt
from mtprun.data.prompts import PromptDataset
from mtprun.data.tasks.base import Task, step_seed

if TYPE_CHECKING:
    from mtprun.spec.data import DatasetSpec


class DatasetPromptTask(Task):
    """Single-turn prompts from a dataset (see PromptDataset): RL steps walk a seeded stream
    of epochs (a dynamic-sampling round after a step's first draws its rows from (seed, step,
    round) instead, so the stream stays a function of the step), evaluations read the
    held-out rows."""

    def __init__(self, spec: DatasetSpec, seed: int, cache_dir: str | Path | None = None):
        self.name = spec.path
        self.data = PromptDataset(spec, seed, cache_dir)

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        return self.data.sample(n, seed)

    def step_prompts(self, n: int, seed: int, step: int, sampling_round: int = 0) -> list[Prompt]:
        if sampling_round:  # extra prompts of dynamic sampling: drawn, the stream goes on
            return self.data.sample(n, step_seed(seed, step, sampling_round))
        return self.data.stream((step - 1) * n, n)

    def heldout_prompts(self, n: int | None, seed: int) -> list[Prompt]:
        return self.data.heldout(n)
