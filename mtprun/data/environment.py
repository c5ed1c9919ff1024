"""Environments: what answers the model between its turns in a multi-turn episode.

The runner makes one environment object per episode (the class is called with no
arguments) and drives it:

    messages = env.reset(prompt)        # the conversation the episode starts from
    loop:                               # at most task.max_turns assistant turns
        the policy samples an assistant turn (tool calls parsed with the chat template)
        result = env.step(conversation) # the whole conversation so far, that turn last
        result.done -> the episode ends (result.reward, when given, is its reward)
        else result.messages (tool results, user replies) are appended and the policy
        samples again

`reset` and `step` may be plain or `async def` methods; the async ones of all episodes of a
turn run concurrently on one event loop. Subclassing `Environment` is optional: any class
with these two methods works.

Tools the model may call are shown to it by the chat template, which prints their specs
(`episode_tools`): the prompt's (its dataset row's `tools` column), else the environment's
`tools` attribute (a list of OpenAI-style tool specs, see `messages.ToolSpec`). The calls the
model makes are parsed from its turn (by the model family's `renderers` parser, or the
template's syntax) into the last message's `tool_calls`, which `step` answers.
"""

from __future__ import annotations

import asyncio
import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mtprun.data.messages import (
    Conversation,
    ConversationError,
    Message,
    Prompt,
    ToolSpec,
    parse_conversation,
    parse_tools,
)

T = TypeVar("T")

INTERFACE = (
    "an environment class is called with no arguments and has reset(prompt) -> messages "
    "and step(messages) -> EnvStep(messages, done, reward=None), plain or async"
)


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to the model's last turn.

    messages: tool results / user replies for the model to read before its next turn
              (`Message`s or `{"role", "content"}` dicts; never the assistant's).
    done:     True ends the episode (messages are then ignored).
    reward:   the episode's reward, or None to let the recipe's task.reward score it. The
              last reward an environment gives during an episode is the one that counts.
    components: named parts of `reward` (a rubric's rewards before weighting, say), each
              logged as reward/<name>; given only with a reward.
    """

    messages: Sequence[Message | Mapping[str, Any]] = ()
    done: bool = False
    reward: float | None = None
    components: Mapping[str, float] | None = None


class Environment(ABC):
    """Base class of environments (optional: any class with `reset` and `step` works)."""

    def reset(self, prompt: Prompt) -> Sequence[Message]:
        """The conversation the episode starts from: by default the prompt's messages."""
        return prompt.messages

    @abstractmethod
    def step(self, messages: Conversation) -> EnvStep:
        """Answer the conversation so far, whose last message is the model's turn."""


class SingleTurn(Environment):
    """The environment of single-turn tasks: the episode ends after the model's answer."""

    def step(self, messages: Conversation) -> EnvStep:
        return EnvStep(done=True)


def interface_problem(cls: Any) -> str | None:
    """Why `cls` cannot serve as an environment, or None when it can."""
    if not inspect.isclass(cls):
        return f"{_name(cls)} is not a class ({INTERFACE})"
    for method, argument in (("reset", "prompt"), ("step", "messages")):
        fn = getattr(cls, method, None)
        if not callable(fn):
            return f"class {cls.__name__} has no method {method}({argument}) ({INTERFACE})"
        if getattr(fn, "__isabstractmethod__", False):
            return f"class {cls.__name__} does not implement {method}({argument})"
        if not _accepts(fn, 2):
            return (
                f"{cls.__name__}.{method}{_signature(fn)} does not take one argument "
                f"({argument}) after self ({INTERFACE})"
            )
    if not _accepts(cls, 0):
        return f"class {cls.__name__}{_signature(cls)} cannot be called without arguments"
    return None


def make_environment(cls: type) -> Any:
    problem = interface_problem(cls)
    if problem is not None:
        raise TypeError(problem)
    return cls()


def reset_all(envs: Sequence[Any], prompts: Sequence[Prompt]) -> list[Conversation]:
    """Each environment's starting conversation for its prompt."""
    results = _run_all([env.reset(p) for env, p in zip(envs, prompts, strict=True)])
    return [_starting_messages(env, messages) for env, messages in zip(envs, results, strict=True)]


def step_all(envs: Sequence[Any], conversations: Sequence[Conversation]) -> list[EnvStep]:
    """Each environment's answer to its conversation."""
    results = _run_all([env.step(c) for env, c in zip(envs, conversations, strict=True)])
    return [_checked_step(env, result) for env, result in zip(envs, results, strict=True)]


def episode_tools(env: Any, prompt: Prompt, prints_tools: bool = True) -> tuple[ToolSpec, ...]:
    """The tool specs the chat template prints for an episode: its prompt's (the dataset
    row's `tools`), else its environment's `tools` attribute, else none. ValueError for an
    attribute that is not a list of tool specs. `prints_tools` False (mtprun's own tiny chat
    formats print none): the environment's tools are called unprinted, in the template's
    syntax (as calculator_tool's calculator), so none are returned for them; a prompt's own
    still are (and refused by such a template)."""
    if prompt.tools:
        return prompt.tools
    declared = getattr(env, "tools", None)
    if declared is None:
        return ()
    try:
        tools = parse_tools(declared)
    except ConversationError as err:
        raise ValueError(f"{_name(env)}.tools is not a list of tool specs: {err}") from err
    return tools if prints_tools else ()


def inserted_messages(step: EnvStep) -> Conversation:
    """The messages of a step that does not end the episode, as `Message`s."""
    return tuple(m if isinstance(m, Message) else parse_conversation([m])[0] for m in step.messages)


def _run_all(results: list[T | Awaitable[T]]) -> list[T]:
    """The results, with the awaitable ones awaited concurrently on one event loop."""
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if not pending:
        return results  # type: ignore[return-value]

    async def gather() -> list[Any]:
        return await asyncio.gather(*(results[i] for i in pending))  # type: ignore[misc]

    done = list(results)
    for i, value in zip(pending, asyncio.run(gather()), strict=True):
        done[i] = value
    return done  # type: ignore[return-value]


def _starting_messages(env: Any, messages: Any) -> Conversation:
    try:
        conversation = parse_conversation([_as_dict(m) for m in messages])
    except (ConversationError, TypeError) as err:
        raise ValueError(f"{_name(env)}.reset returned no valid conversation: {err}") from err
    if conversation[-1].role == "assistant":
        raise ValueError(
            f"{_name(env)}.reset returned a conversation ending with an assistant message; "
            "the episode starts with the model's turn"
        )
    return conversation


def _checked_step(env: Any, result: Any) -> EnvStep:
    where = f"{_name(env)}.step"
    if not isinstance(result, EnvStep):
        raise TypeError(f"{where} returned {type(result).__name__}, not EnvStep ({INTERFACE})")
    if result.reward is not None and not isinstance(result.reward, int | float):
        raise TypeError(f"{where}: reward must be a number or None, not {result.reward!r}")
    if result.components is not None and (
        result.reward is None
        or not all(isinstance(v, int | float) for v in result.components.values())
    ):
        raise TypeError(
            f"{where}: components must be numbers, given with the reward they make up, not "
            f"{result.components!r} with reward {result.reward!r}"
        )
    if result.done:
        return result
    try:
        messages = inserted_messages(result)
    except ConversationError as err:
        raise ValueError(f"{where} returned a bad message: {err}") from err
    if not messages or any(m.role == "assistant" for m in messages):
        raise ValueError(
            f"{where} returned done=False with {len(messages)} message(s): an episode that "
            "goes on needs at least one tool or user message and no assistant message (the "
            "model writes its own turns)"
        )
    return result


def _as_dict(message: Any) -> Any:
    return message.to_dict() if isinstance(message, Message) else message


def _accepts(fn: Any, count: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:
        return True  # no signature to read (a builtin): assume it fits
    return True


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _name(obj: Any) -> str:
    """A class's or function's name; an instance's class name."""
    named = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    return getattr(named, "__qualname__", repr(obj))
