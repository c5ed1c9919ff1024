"""The source extension points: where a task's prompts come from, what kind of task it is, and
what scores its episodes. Each source is one unit module under `mtprun/sources/` (see that
package's docstring for the design and `RewardSource` / `PromptSource` / `TaskSource` below for
the contracts); the module lists here are the only lists of them.

The recipe language derives from the units: the `task.reward` / `task.rewards` / `task.prompts`
unions (each unit's `type:`-tagged config is one member), the tag of an untagged value (each
unit's `infer`), and `task.type`. The layers above dispatch through `reward_source`,
`prompt_source` and `task_source`; nothing else names a source.

The units are imported by path (mtprun.units) when this module is imported: a unit module
imports only the recipe language at its top (its check and factory import what they run on
inside the function), so reading a recipe never loads the data or runner layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Protocol, Union, runtime_checkable

from pydantic import Discriminator, Tag

from mtprun.units import Units, register_point

Problems = Iterator[tuple[tuple[str | int, ...], str] | tuple[tuple[str | int, ...], str, str]]
"""A preflight check's findings: (key path below the source's own value, message), and
"warning" as a third item for a warning (a deprecation note)."""


@runtime_checkable
class RewardSource(Protocol):
    """What scores episodes (`task.reward`, an entry of `task.rewards`).

    NAME       its `type:` tag.
    CONFIG     the config of `task.reward: {type: NAME, ...}`; None: a string names it.
    TERM       the config of an entry of task.rewards (CONFIG's fields, `weight` and `name`);
               its `.spec` is the one-reward form the functions below take.
    infer(value)      whether an untagged recipe value (a string or a mapping) is this source's.
    label(spec)       its metric name in task.rewards when it sets no `name:`.
    describe(spec)    how messages name it.
    actors(spec)      Ray actors it runs beside the rollout engines (a served model: 1).
    check(spec)       preflight: what is wrong with it outside the recipe (files, code).
    scoring(spec)     its factory: a plain description of how the runner scores with it
                      (mtprun.sources.scoring).
    """

    NAME: str
    CONFIG: Any
    TERM: Any

    def infer(self, value: Any) -> bool: ...
    def label(self, spec: Any) -> str: ...
    def describe(self, spec: Any) -> str: ...
    def actors(self, spec: Any) -> int: ...
    def check(self, spec: Any) -> Problems: ...
    def scoring(self, spec: Any) -> Any: ...


@runtime_checkable
class PromptSource(Protocol):
    """A dataset of prompts (`task.prompts`, `eval.prompts`).

    NAME       its `type:` tag.
    CONFIG     its config (a Section with `type: Literal[NAME]`).
    infer(value)      whether an untagged mapping is this source's.
    describe(config)  how messages name it.
    default_reward(config)   the reward that scores its prompts when the task names none.
    check(config)     preflight: what is wrong with it outside the recipe.
    task(config, seed, cache_dir)       its factory: the task (mtprun.data.tasks.Task).
    eval_prompts(config, seed, n, cache_dir)   the prompts of an `eval.prompts` of it.
    """

    NAME: str
    CONFIG: Any

    def infer(self, value: Any) -> bool: ...
    def describe(self, config: Any) -> str: ...
    def default_reward(self, config: Any) -> str | None: ...
    def check(self, config: Any) -> Problems: ...
    def task(self, config: Any, seed: int, cache_dir: Any) -> Any: ...
    def eval_prompts(self, config: Any, seed: int, n: int | None, cache_dir: Any) -> list[Any]: ...


@runtime_checkable
class TaskSource(Protocol):
    """What a `task:` section runs (`task.type`, inferred from its fields when unset).

    NAME       its `type:` tag.
    infer(data)       whether an untagged task section (its mapping) is this source's.
    default_reward(task)     the reward of its episodes when the task names none.
    check(task)       preflight: what is wrong with it outside the recipe.
    task(task, seed, cache_dir)   its factory: the task (mtprun.data.tasks.Task).
    """

    NAME: str

    def infer(self, data: dict[str, Any]) -> bool: ...
    def default_reward(self, task: Any) -> str | None: ...
    def check(self, task: Any) -> Problems: ...
    def task(self, task: Any, seed: int, cache_dir: Any) -> Any: ...


REWARD_SOURCES: Units[RewardSource] = register_point(
    Units(
        "reward source",
        RewardSource,
        (
            "mtprun.sources.rewards.function",
            "mtprun.sources.rewards.endpoint",
            "mtprun.sources.rewards.served",
        ),
    )
)
PROMPT_SOURCES: Units[PromptSource] = register_point(
    Units(
        "prompt source",
        PromptSource,
        ("mtprun.sources.prompts.dataset", "mtprun.sources.prompts.reasoning_gym"),
    )
)
TASK_SOURCES: Units[TaskSource] = register_point(
    Units(
        "task source",
        TaskSource,
        (
            "mtprun.sources.tasks.verifiers",
            "mtprun.sources.tasks.search",
            "mtprun.sources.tasks.builtin",
            "mtprun.sources.tasks.prompts",
        ),
    )
)
"""In inference order: the first whose `infer` takes an untagged task section is its type."""

DEFAULT_REWARD_MAPPING = "endpoint"
"""An untagged reward mapping that no unit claims is read as this (as before `type:`)."""
DEFAULT_TERM = "function"
"""An untagged entry of task.rewards that no unit claims is read as this."""
DEFAULT_PROMPTS = "dataset"
"""An untagged prompts mapping that no unit claims is read as this."""


def _tag(point: str, name: str) -> str:
    # Tags no recipe key spells, so that error locations skip them (spec/diagnose.py).
    return f"<{point} {name}>"


def _inferred(units: Iterable[Any], value: Any, default: str) -> str:
    """The `type:` of a recipe value: its own, else the first unit that claims it."""
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return value["type"]
    return next((unit.NAME for unit in units if unit.infer(value)), default)


def _reward_tag(value: Any) -> str:
    if isinstance(value, dict):  # one of the units a mapping configures
        mappings = [unit for unit in REWARD_SOURCES if unit.CONFIG is not None]
        return _tag("reward", _inferred(mappings, value, DEFAULT_REWARD_MAPPING))
    if isinstance(value, str):
        return _tag("reward", _inferred(REWARD_SOURCES, value, DEFAULT_TERM))
    return _tag("reward", getattr(value, "type", DEFAULT_TERM))


def _term_tag(value: Any) -> str:
    if isinstance(value, dict):
        return _tag("term", _inferred(REWARD_SOURCES, value, DEFAULT_TERM))
    return _tag("term", getattr(value, "type", DEFAULT_TERM))


def _prompts_tag(value: Any) -> str:
    if isinstance(value, dict):
        return _tag("prompts", _inferred(PROMPT_SOURCES, value, DEFAULT_PROMPTS))
    return _tag("prompts", getattr(value, "type", DEFAULT_PROMPTS))


def _reward_members() -> tuple[Any, ...]:
    members: list[Any] = []
    for unit in REWARD_SOURCES:
        config = str if unit.CONFIG is None else unit.CONFIG
        members.append(Annotated[config, Tag(_tag("reward", unit.NAME))])
    return tuple(members)


RewardSpec = Annotated[
    Union[_reward_members()],  # noqa: UP007 (a union built from the units)
    Discriminator(_reward_tag),
]
"""One reward (`task.reward`): a built-in's name or a function reference (a string), or a
mapping tagged `type:` (inferred from its fields when unset)."""

RewardTerm = Annotated[
    Union[tuple(Annotated[u.TERM, Tag(_tag("term", u.NAME))] for u in REWARD_SOURCES)],  # noqa: UP007
    Discriminator(_term_tag),
]
"""One entry of task.rewards: a reward source's config with `weight` and `name`."""

PromptSpec = Annotated[
    Union[tuple(Annotated[u.CONFIG, Tag(_tag("prompts", u.NAME))] for u in PROMPT_SOURCES)],  # noqa: UP007
    Discriminator(_prompts_tag),
]
"""A dataset of prompts: one prompt source's config, tagged `type:` (inferred when unset)."""


def reward_source(spec: Any) -> RewardSource:
    """The unit of one reward (a string, or a config with its `type`)."""
    return REWARD_SOURCES[getattr(spec, "type", DEFAULT_TERM)]


def prompt_source(config: Any) -> PromptSource:
    """The unit of a prompts config."""
    return PROMPT_SOURCES[config.type]


def task_source(task: Any) -> TaskSource:
    """The unit of a task section (its `type`)."""
    return TASK_SOURCES[task.type]


def infer_task_type(data: dict[str, Any]) -> str | None:
    """The `type` of an untagged task section: the first task source that claims it."""
    return next((unit.NAME for unit in TASK_SOURCES if unit.infer(data)), None)
