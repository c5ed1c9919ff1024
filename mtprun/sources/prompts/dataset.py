"""A local dataset of prompts: `{type: dataset, path, columns, shuffle, heldout}` (untagged: a
mapping with `path`, or a bare path), read with Hugging Face `datasets`.

Fulfils mtprun.spec.sources.PromptSource: preflight finds its file or folder; its task walks
the rows in seeded epochs (mtprun.data.tasks.dataset_prompts) and an evaluation reads its rows.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from mtprun.spec.base import Section

if TYPE_CHECKING:
    from mtprun.spec.sources import Problems

NAME = "dataset"
SUFFIXES = (".jsonl", ".parquet", ".arrow", ".csv")
"""Files a dataset path may name (or a folder may hold); see mtprun/data/dataset_files.py."""


class ColumnMap(Section):
    """Which columns of a dataset hold what mtprun reads; every column reaches the reward."""

    prompt: str | None = Field(
        None,
        description="Column of the prompt: a string (one user message) or a list of messages. "
        "Null: `messages` when the dataset has that column, else `prompt`.",
    )
    messages: str | None = Field(
        None, description="Column of a conversation (a list of {role, content} messages)."
    )
    answer: str = Field(
        "answer",
        description="Column of the reference answer handed to the reward (optional: a "
        "dataset without it gives every prompt answer null).",
    )

    @model_validator(mode="after")
    def _one_prompt_column(self) -> ColumnMap:
        if self.prompt is not None and self.messages is not None:
            raise ValueError(
                "name the prompt column (`prompt:`) or the conversation column "
                "(`messages:`), not both"
            )
        return self


class DatasetSpec(Section):
    """A local dataset, read with Hugging Face `datasets` (memory-mapped Arrow)."""

    type: Literal["dataset"] = Field(
        "dataset", description="A local dataset (inferred from `path`)."
    )
    path: str = Field(
        ...,
        description="A .jsonl, .parquet, .arrow or .csv file, a folder of them, or a folder "
        "written by `datasets.save_to_disk` (relative to the recipe file that sets it).",
    )
    columns: ColumnMap = Field(
        default_factory=ColumnMap, description="Column names, when not the default ones."
    )
    shuffle: bool = Field(
        True,
        description="Visit the rows in a seeded order, a new one each epoch (false: file order).",
    )
    heldout: float = Field(
        0,
        ge=0,
        description="Rows held out of training for evaluation: a count (>= 1), or a fraction "
        "of the rows (< 1); drawn with the recipe's seed.",
    )

    @field_validator("heldout")
    @classmethod
    def _count_or_fraction(cls, value: float) -> float:
        if value >= 1 and not float(value).is_integer():
            raise ValueError(
                f"heldout {value} is neither a row count (a whole number) nor a fraction (< 1)"
            )
        return value

    def heldout_rows(self, rows: int) -> int:
        """How many of `rows` rows are held out."""
        if self.heldout < 1:
            return math.floor(self.heldout * rows)
        return min(int(self.heldout), rows)


CONFIG = DatasetSpec


def infer(value: Any) -> bool:
    return isinstance(value, dict) and "path" in value


def describe(config: DatasetSpec) -> str:
    return config.path


def default_reward(config: DatasetSpec) -> str | None:
    return None


def file_problem(file: str) -> str | None:
    """What is wrong with a dataset path on disk, or None."""
    if not os.path.exists(file):
        return f"file not found: {file}"
    if os.path.isfile(file) and not file.endswith(SUFFIXES):
        return f"{file} is not a dataset file: use {', '.join(SUFFIXES)}"
    return None


def check(config: DatasetSpec) -> Problems:
    problem = file_problem(config.path)
    if problem is not None:
        yield ("path",), problem


def task(config: DatasetSpec, seed: int, cache_dir: str | Path | None) -> Any:
    from mtprun.data.tasks.dataset_prompts import DatasetPromptTask

    return DatasetPromptTask(config, seed, cache_dir)


def eval_prompts(
    config: DatasetSpec, seed: int, n: int | None, cache_dir: str | Path | None
) -> list[Any]:
    """The first `n` training rows (all without `n`) of an evaluation's own dataset."""
    from mtprun.data.prompts import PromptDataset

    data = PromptDataset(config, seed, cache_dir)
    return [data.prompt(int(r)) for r in data.train_rows[:n]]
