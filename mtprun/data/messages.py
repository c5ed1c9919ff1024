"""Chat messages: the plain data every template renders, parsed from untrusted records, and
the prompt an RL episode starts from."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = get_args(Role)


class ConversationError(ValueError):
    """A record is not a valid conversation; the message says which part and why."""


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant makes: a tool name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """The call as the templates print it: compact, argument keys sorted.

        The Jinja templates print the same form with `tojson`, so both renderings match.
        """
        arguments = json.dumps(
            self.arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        return f'{{"name":{json.dumps(self.name, ensure_ascii=False)},"arguments":{arguments}}}'


@dataclass(frozen=True)
class Message:
    """One chat message; `reasoning_content` is an assistant's thinking (the text a reasoning
    template prints inside `<think>...</think>`), empty when it has none."""

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_content: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face / OpenAI chat-message form that `apply_chat_template` takes."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return out


Conversation = tuple[Message, ...]

ToolSpec = dict[str, Any]
"""A tool the model may call, in the OpenAI function-calling form the chat templates print:
`{"type": "function", "function": {"name", "description", "parameters"}}` or the flat
`{"name", "description", "parameters"}`; kept as given (a template prints it verbatim)."""

TOOLS_COLUMN = "tools"  # a dataset row's tool specs, printed by the chat template


@dataclass(frozen=True)
class Prompt:
    """A prompt, its reference answer (None when the dataset has none), the tools the model
    may call (the row's `tools` column, printed by the chat template), and its record: every
    column of the dataset row it came from, handed to the reward."""

    messages: Conversation
    answer: str | None
    record: Mapping[str, Any] | None = field(default=None, compare=False)
    tools: tuple[ToolSpec, ...] = field(default=(), hash=False)

    def columns(self) -> dict[str, Any]:
        """The record the reward receives (a synthetic prompt's: messages and answer)."""
        if self.record is not None:
            return dict(self.record)
        return {"messages": [m.to_dict() for m in self.messages], "answer": self.answer}


def parse_conversation(record: Any) -> Conversation:
    """Validate one record: `{"messages": [...]}` or a bare list of messages.

    Each message is `{"role", "content", "tool_calls"?, "reasoning_content"?}` (reasoning:
    an assistant's thinking, a string); a tool call is
    `{"name", "arguments"}` or the OpenAI form `{"type": "function", "function": {...}}`,
    with arguments a JSON object or a string holding one. Raises ConversationError.
    """
    messages = record.get("messages") if isinstance(record, Mapping) else record
    if isinstance(record, Mapping) and messages is None:
        raise ConversationError('record has no "messages" key (expected {"messages": [...]})')
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ConversationError(f'"messages" must be a list, got {type(messages).__name__}')
    if not messages:
        raise ConversationError("empty conversation: no messages to train on")
    return tuple(_parse_message(i, m) for i, m in enumerate(messages))


def parse_tools(value: Any) -> tuple[ToolSpec, ...]:
    """A record's tool specs (see `ToolSpec`): a list of them, JSON text holding one (csv
    files), or null / absent for none. Raises ConversationError naming the bad spec."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as err:
            raise ConversationError(f"tools: not a JSON list of tool specs: {err.msg}") from None
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise ConversationError(f"tools must be a list of tool specs, got {type(value).__name__}")
    return tuple(_parse_tool_spec(i, spec) for i, spec in enumerate(value))


def _parse_tool_spec(index: int, raw: Any) -> ToolSpec:
    where = f"tools[{index}]"
    if not isinstance(raw, Mapping):
        raise ConversationError(f"{where}: a tool spec is an object, got {type(raw).__name__}")
    function = raw.get("function", raw)
    if "function" in raw and raw.get("type", "function") != "function":
        raise ConversationError(f'{where}: type {raw.get("type")!r} (only "function" tools)')
    if not isinstance(function, Mapping):
        raise ConversationError(f'{where}: "function" must be an object')
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ConversationError(
            f'{where}: a tool spec needs a string "name" (as {{"type": "function", '
            '"function": {"name", "description", "parameters"}} or {"name", ...})'
        )
    parameters = function.get("parameters", {})
    if not isinstance(parameters, Mapping):
        raise ConversationError(f"{where} ({name}): parameters must be a JSON-schema object")
    return _plain(raw)


def _plain(value: Any) -> Any:
    """`value` as plain dicts and lists (Arrow rows may hold other mappings and sequences)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return value


def _parse_message(index: int, raw: Any) -> Message:
    where = f"message {index}"
    if not isinstance(raw, Mapping):
        raise ConversationError(f"{where}: must be an object, got {type(raw).__name__}")
    role = raw.get("role")
    if role not in ROLES:
        raise ConversationError(f"{where}: unknown role {role!r} (expected one of {ROLES})")
    content = raw.get("content", "")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ConversationError(f"{where}: content must be a string, got {type(content).__name__}")
    calls = raw.get("tool_calls") or ()
    if calls and role != "assistant":
        raise ConversationError(f"{where}: only assistant messages carry tool_calls, not {role}")
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise ConversationError(f"{where}: tool_calls must be a list")
    reasoning = raw.get("reasoning_content") or ""
    if not isinstance(reasoning, str):
        raise ConversationError(f"{where}: reasoning_content must be a string")
    if reasoning and role != "assistant":
        raise ConversationError(f"{where}: only assistant messages carry reasoning_content")
    calls = tuple(_parse_tool_call(where, c) for c in calls)
    return Message(role, content, calls, reasoning)


def _parse_tool_call(where: str, raw: Any) -> ToolCall:
    if isinstance(raw, Mapping) and isinstance(raw.get("function"), Mapping):
        raw = raw["function"]
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise ConversationError(f'{where}: a tool call needs a string "name"')
    arguments = raw.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ConversationError(f"{where}: tool-call arguments are not JSON: {err}") from err
    if not isinstance(arguments, Mapping):
        raise ConversationError(f"{where}: tool-call arguments must be a JSON object")
    return ToolCall(raw["name"], dict(arguments))
