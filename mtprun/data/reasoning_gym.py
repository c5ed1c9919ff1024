"""reasoning-gym datasets (the `reasoning-gym` package): procedurally generated prompts whose
dataset scores its own answers.

An entry {question, answer, metadata} becomes a one-message prompt whose record keeps the
entry and, under `reasoning_gym`, the dataset that made it, so that the built-in
`reasoning_gym` reward (in a reward worker, from the record alone) rebuilds the dataset and
calls its `score_answer(answer, entry)`.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from typing import TYPE_CHECKING, Any

from mtprun.data.messages import Message, Prompt

if TYPE_CHECKING:
    from mtprun.spec.data import ReasoningGymSpec

RECORD_KEY = "reasoning_gym"  # the record's column naming the entry's dataset
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def dataset_names() -> list[str]:
    """The names reasoning-gym registers."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def dataset_problem(name: str, config: dict[str, Any]) -> tuple[str, str] | None:
    """What is wrong with dataset `name` under `config`: ("name" | "config", message), or None
    when it builds."""
    from mtprun.spec.errors import did_you_mean

    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        shown = ", ".join(names[:12])
        return "name", (
            f"unknown reasoning-gym dataset {name!r}{hint}; reasoning-gym has {len(names)} "
            f"({shown}, ...: the keys of reasoning_gym.factory.DATASETS)"
        )
    fields = _config_fields(name)
    for key in config:
        if fields is not None and key not in fields:
            return "config", (
                f"reasoning-gym dataset {name!r} has no config field {key!r}"
                f"{did_you_mean(key, fields)}; its fields: {', '.join(fields)}"
            )
    try:
        build(name, json.dumps(config, sort_keys=True), 1, 0)
    except Exception as err:  # the dataset's config class and its validate() say why
        reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return "config", f"reasoning-gym dataset {name!r} rejects this config: {reason}"
    return None


def _config_fields(name: str) -> list[str] | None:
    """The config fields of dataset `name` a recipe may set (None: not a dataclass)."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    config_class = DATASETS[name][1]
    if not dataclasses.is_dataclass(config_class):
        return None
    return [f.name for f in dataclasses.fields(config_class) if f.name not in ("size", "seed")]


@functools.lru_cache(maxsize=16)
def build(name: str, config_json: str, size: int, seed: int) -> Any:
    """The dataset (cached: entries are generated from (seed, index) when read)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config_json))


class GymDataset:
    """The entries of one reasoning-gym dataset as prompts."""

    def __init__(self, spec: ReasoningGymSpec, seed: int) -> None:
        self.name = spec.reasoning_gym
        self.size = spec.size
        self.seed = seed
        self.config = dict(spec.config)
        self._config_json = json.dumps(self.config, sort_keys=True)
        self.dataset = build(self.name, self._config_json, self.size, seed)

    def prompt(self, index: int) -> Prompt:
        entry = self.dataset[index]
        source = {
            "dataset": self.name,
            "config": self.config,
            "size": self.size,
            "seed": self.seed,
        }
        record = {
            "question": entry["question"],
            "answer": entry["answer"],
            "metadata": entry.get("metadata", {}),
            RECORD_KEY: source,
        }
        answer = entry["answer"]
        return Prompt(
            (Message("user", entry["question"]),),
            None if answer is None else str(answer),
            record,
        )


def score(prompt: dict[str, Any], completion: str) -> float:
    """The entry's dataset's score of `completion` (the text of an `<answer>` tag when it
    has one, else the whole completion, stripped)."""
    source = prompt.get(RECORD_KEY)
    if not isinstance(source, dict):
        raise ValueError(
            "the reasoning_gym reward scores prompts of a reasoning-gym dataset "
            "(task.prompts: {reasoning_gym: <name>}); this prompt's record has no "
            f"{RECORD_KEY!r} column"
        )
    dataset = build(
        source["dataset"],
        json.dumps(source["config"], sort_keys=True),
        source["size"],
        source["seed"],
    )
    tagged = _ANSWER_TAG.findall(completion)
    answer = tagged[-1].strip() if tagged else completion.strip()
    entry = {k: prompt[k] for k in ("question", "answer", "metadata")}
    return float(dataset.score_answer(answer, entry))
