"""Reading tool calls back out of a generated assistant turn, per chat-template family.

- `TaggedJson`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, once per call
  (Hermes, Qwen, mtprun's own templates);
- `BareJson`: the whole turn is one JSON object `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), optionally after `<|python_tag|>` (Llama 3.1+ JSON tool calling);
- `NameLineJson`: the tool's name on the first line, its JSON arguments after it (GLM-4).

A model's own template is matched to the syntax that reads its rendering of a probe call back
(`mtprun.data.templates.model_template`).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

from mtprun.data.messages import Message, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class ToolCallSyntax(ABC):
    name: str

    @abstractmethod
    def parse(self, text: str) -> Message:
        """The assistant message behind `text` (stop token already stripped). Text that does
        not hold well-formed calls is kept as content, so a reward sees what was written."""


class NoToolCalls(ToolCallSyntax):
    """A template that renders no tool calls mtprun can read: everything is content."""

    name = "none"

    def parse(self, text: str) -> Message:
        return Message("assistant", text)


class TaggedJson(ToolCallSyntax):
    name = "tagged-json"
    _CALL = re.compile(
        re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S
    )

    def parse(self, text: str) -> Message:
        calls: list[ToolCall] = []
        for match in self._CALL.finditer(text):
            call = _call_from_json(match.group(1))
            if call is None:
                return Message("assistant", text)
            calls.append(call)
        if not calls:
            return Message("assistant", text)
        content = text.split(TOOL_CALL_OPEN, 1)[0].rstrip("\n")
        return Message("assistant", content, tuple(calls))


class BareJson(ToolCallSyntax):
    name = "bare-json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> Message:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        call = _call_from_json(body) if body.startswith("{") else None
        if call is None:
            return Message("assistant", text)
        return Message("assistant", "", (call,))


class NameLineJson(ToolCallSyntax):
    name = "name-line-json"
    _CALL = re.compile(r"\s*([\w.-]+)\n(\{.*\})\s*", re.S)

    def parse(self, text: str) -> Message:
        match = self._CALL.fullmatch(text)
        call = None if match is None else _call_from_json(match.group(2), match.group(1))
        if call is None:
            return Message("assistant", text)
        return Message("assistant", "", (call,))


SYNTAXES: tuple[ToolCallSyntax, ...] = (TaggedJson(), BareJson(), NameLineJson())


def _call_from_json(text: str, name: str | None = None) -> ToolCall | None:
    """The call in `text`: `{"name", "arguments" | "parameters"}`, or, with `name` given, the
    arguments object alone."""
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError:
        return None
    if name is not None:
        raw = {"name": name, "arguments": raw}
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI wire form: a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(raw["name"], arguments) if isinstance(arguments, dict) else None
