"""How mtprun calls a reward function, and what it accepts back.

A reward takes any of these arguments, by name (declare the ones you need, or `**kwargs`):

    prompt      dict: the prompt's record, every column of its dataset row
    completion  str: the text of the episode's final assistant message ("" when the episode
                ended on a tool call)
    messages    list[dict]: the whole episode, prompt included, as {"role", "content",
                "tool_calls"?} messages (the OpenAI / Hugging Face chat form)
    answer      str | None: the reference answer (the dataset's answer column)

and returns a float, or a mapping of named float components with a `total` (the episode's
reward; the other components are logged as `reward/<name>`). `async def` rewards are awaited.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mtprun.data.messages import Conversation, Prompt

REWARD_ARGUMENTS = ("prompt", "completion", "messages", "answer")
RESERVED_COMPONENTS = ("mean", "std", "errors")  # reward/<name> metrics mtprun logs itself
_METRIC_NAME = re.compile(r"[A-Za-z0-9_./-]+")  # a subset of what MLflow accepts


class RewardValueError(ValueError):
    """A reward returned something that is not a finite reward."""


@dataclass(frozen=True)
class RewardInput:
    """Everything a reward may ask for about one episode (picklable: it travels to workers)."""

    prompt: dict[str, Any]
    completion: str
    messages: list[dict[str, Any]]
    answer: str | None

    @classmethod
    def of(cls, prompt: Prompt, conversation: Conversation) -> RewardInput:
        return cls(
            prompt=prompt.columns(),
            completion=final_text(conversation),
            messages=[m.to_dict() for m in conversation],
            answer=prompt.answer,
        )


def final_text(conversation: Conversation) -> str:
    """The content of the last assistant message; "" when it called a tool (no answer)."""
    for message in reversed(conversation):
        if message.role == "assistant":
            return "" if message.tool_calls else message.content
    return ""


def passed_arguments(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments `fn` receives: the ones it names, or all of them with **kwargs."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return REWARD_ARGUMENTS
    return tuple(p.name for p in parameters if p.name in REWARD_ARGUMENTS)


def call_reward(fn: Callable[..., Any], episode: RewardInput) -> dict[str, float]:
    """`fn` on one episode (awaited when async): its components, `total` included. Raises
    what `fn` raises, and RewardValueError for a result that is not a finite reward."""
    result = fn(**{name: getattr(episode, name) for name in passed_arguments(fn)})
    if inspect.isawaitable(result):
        result = asyncio.run(_wait(result))
    return reward_components(result)


async def _wait(awaitable: Any) -> Any:
    return await awaitable


def reward_components(result: Any) -> dict[str, float]:
    """A reward's return value as {component: value} with a finite `total`."""
    if isinstance(result, Mapping):
        if "total" not in result:
            raise RewardValueError(
                f"returned a mapping without 'total' (keys: {', '.join(map(str, result))}); "
                "a mapping of components needs the episode's reward under 'total'"
            )
        components = {_name(k): _number(f"component {k!r}", v) for k, v in result.items()}
        reserved = sorted(set(components) & set(RESERVED_COMPONENTS))
        if reserved:
            raise RewardValueError(
                f"component name(s) {reserved} are reserved (mtprun logs reward/mean, "
                "reward/std and reward/errors itself); rename them"
            )
        return components
    return {"total": _number("the reward", result)}


def _name(key: Any) -> str:
    if not isinstance(key, str) or not _METRIC_NAME.fullmatch(key):
        raise RewardValueError(
            f"component name {key!r} is not a metric name: use letters, digits and _ - . /"
        )
    return key


def _number(what: str, value: Any) -> float:
    if isinstance(value, numbers.Real):  # bool and numpy floats included
        number = float(value)
    else:
        raise RewardValueError(
            f"{what} is a {type(value).__name__} ({value!r:.80}); a reward returns a float or "
            "a mapping of float components with a 'total'"
        )
    if not math.isfinite(number):
        raise RewardValueError(f"{what} is {number} (not finite)")
    return number
