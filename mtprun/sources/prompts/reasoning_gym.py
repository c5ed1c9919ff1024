"""Prompts of a reasoning-gym dataset: `{type: reasoning_gym, reasoning_gym: <name>, size,
seed, config}` (untagged: a mapping with `reasoning_gym`), procedurally generated, each scored
by its dataset's own `score_answer` (the built-in `reasoning_gym` reward) by default.

Fulfils mtprun.spec.sources.PromptSource: preflight imports reasoning-gym and builds the
dataset (one entry's worth) as the run will; its task walks the entries in seeded epochs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from mtprun.spec.base import Section

if TYPE_CHECKING:
    from mtprun.spec.sources import Problems

NAME = "reasoning_gym"
REWARD = "reasoning_gym"
"""The built-in reward that scores a reasoning-gym prompt with its dataset's score_answer."""


class ReasoningGymSpec(Section):
    """Prompts of a reasoning-gym dataset (procedurally generated, with its own scorer)."""

    type: Literal["reasoning_gym"] = Field(
        "reasoning_gym", description="A reasoning-gym dataset (inferred from `reasoning_gym`)."
    )
    reasoning_gym: str = Field(
        ...,
        description="The reasoning-gym dataset's name (basic_arithmetic, leg_counting, "
        "countdown, ...); its `score_answer` is the reward when task.reward is not set.",
    )
    size: int = Field(
        1000,
        ge=1,
        description="Entries in the dataset (RL steps walk them epoch by epoch, in a seeded "
        "order; an evaluation reads the first eval.num_prompts).",
    )
    seed: int | None = Field(
        None,
        description="The dataset's generation seed (null: the recipe's seed for task.prompts, "
        "a seed drawn from it for eval.prompts, so evaluation entries differ from training's).",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The dataset's own configuration (its config class's fields, such as "
        "min_terms or max_digits); size and seed are set above.",
    )

    @field_validator("config")
    @classmethod
    def _no_size_or_seed(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("size", "seed"):
            if key in value:
                raise ValueError(f"set {key} beside reasoning_gym (prompts.{key}), not in config")
        return value


CONFIG = ReasoningGymSpec


def infer(value: Any) -> bool:
    return isinstance(value, dict) and "reasoning_gym" in value


def describe(config: ReasoningGymSpec) -> str:
    return f"reasoning_gym {config.reasoning_gym}"


def default_reward(config: ReasoningGymSpec) -> str | None:
    return REWARD


def check(config: ReasoningGymSpec) -> Problems:
    from mtprun.data.reasoning_gym import dataset_problem

    problem = dataset_problem(config.reasoning_gym, config.config)
    if problem is not None:
        field, message = problem
        yield ("reasoning_gym" if field == "name" else "config",), message


def task(config: ReasoningGymSpec, seed: int, cache_dir: str | Path | None) -> Any:
    from mtprun.data.tasks.gym_prompts import ReasoningGymTask

    return ReasoningGymTask(config, seed)


def eval_prompts(
    config: ReasoningGymSpec, seed: int, n: int | None, cache_dir: str | Path | None
) -> list[Any]:
    from mtprun.data.tasks.gym_prompts import gym_eval_prompts

    return gym_eval_prompts(config, seed, n)
