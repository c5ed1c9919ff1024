"""How mtprun calls a reward function, and what it accepts back.

A reward takes any of these arguments, by name (declare the ones you need, or `**kwargs`):

    prompt          dict: the prompt's record, every column of its dataset row
    completion      str: the final answer: the content of the episode's final assistant
                    message, without its reasoning ("" when the episode ended on a tool
                    call)
    messages        list[dict]: the whole episode, prompt included, as {"role", "content",
                    "reasoning_content"?, "tool_calls"?} messages (the OpenAI / Hugging Face
                    chat form)
    answer          str | None: the reference answer (the dataset's answer column)
    reasoning       str: the reasoning of the final assistant message ("" without any)
    raw_completion  str: the final assistant turn as the model wrote it: its think block,
                    its answer and its tool-call markup (the stop token left out)

The reasoning is split off by the model family's `renderers` parser (`parse_response`), or,
with mtprun's own templates, as a leading `<think>...</think>` block. Outside a rollout
(`mtprun inspect-data`'s scripted expert) `raw_completion` is the final message's reasoning in
a `<think>` block followed by its content.

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

from mtprun.data.messages import Conversation, Message, Prompt

REWARD_ARGUMENTS = ("prompt", "completion", "messages", "answer", "reasoning", "raw_completion")
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
    reasoning: str = ""
    raw_completion: str = ""

    @classmethod
    def of(
        cls, prompt: Prompt, conversation: Conversation, raw_completion: str | None = None
    ) -> RewardInput:
        """The episode `conversation` of `prompt`; `raw_completion`: the text the model
        generated in its final turn (None: rebuilt from the final message)."""
        final = final_message(conversation)
        if raw_completion is None:
            raw_completion = "" if final is None else written_text(final)
        return cls(
            prompt=prompt.columns(),
            completion=final_text(conversation),
            messages=[m.to_dict() for m in conversation],
            answer=prompt.answer,
            reasoning="" if final is None else final.reasoning_content,
            raw_completion=raw_completion,
        )


def final_message(conversation: Conversation) -> Message | None:
    """The last assistant message, None when there is none."""
    return next((m for m in reversed(conversation) if m.role == "assistant"), None)


def final_text(conversation: Conversation) -> str:
    """The content of the last assistant message, its reasoning left out; "" when it called
    a tool (no answer)."""
    final = final_message(conversation)
    return "" if final is None or final.tool_calls else final.content


def written_text(message: Message) -> str:
    """An assistant message as a reasoning model writes it: its reasoning in a `<think>`
    block, then its content."""
    if not message.reasoning_content:
        return message.content
    return f"<think>\n{message.reasoning_content}\n</think>\n\n{message.content}"


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
