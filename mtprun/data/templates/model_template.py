"""A model's own chat template (any Jinja template, not one of mtprun's), attributed token by
token by rendering the conversation incrementally with the tokenizer's `apply_chat_template`.

For a conversation m_0..m_{n-1} rendered to text T and tokenized (the ids of
`apply_chat_template`):

- **Roles.** Message i's tokens start where the rendering of m_0..m_{i-1} stops agreeing with
  T, at token granularity: a token only partly inside the common prefix belongs to what
  follows. Text the template prints whatever the conversation holds, before the first
  message's own rendering (a BOS token, a default system prompt it injects), is the
  system's. A trailer the template prints only at the very end of a rendering (an EOS after a
  final assistant turn) is thereby filed under the message it follows in T, never under one
  it does not precede. Tokens after the last message (the generation prompt) are the
  assistant's.
- **Sampled flags.** Where the template marks them with `{% generation %}` blocks, exactly
  the marked tokens. Otherwise an assistant turn is what the model emits after the template's
  generation prompt: from where the rendering of m_0..m_{i-1} with `add_generation_prompt`
  stops agreeing with T, through the first stop token, also when the template files that
  token under the next message (GLM's `<|observation|>`): that token is then the assistant's.
- **Stop tokens** are the tokenizer's EOS, the model folder's `generation_config.json`
  `eos_token_id`s, and the template's own turn ends, found by probing: the first special
  token the template prints after an assistant reply, when a user or a tool message follows
  and at the end of the conversation.
- **Tool calls** are read back with the syntax (`tool_calls.SYNTAXES`) that parses the
  template's rendering of a probe call into that call, after a leading `<think>...</think>`
  block, which is the turn's reasoning (`reasoning.py`).
- **Tool specs** (`tools`) go to the template, which prints them (a header before the first
  message is then the system's, like any preamble); a template that prints no tools is an
  error when a prompt has some.

A template whose renderings of successive prefixes do not agree (it rewrites earlier
messages once later ones exist) cannot be attributed and is an error.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mtprun.data.messages import Message, Role, ToolCall, ToolSpec
from mtprun.data.templates.reasoning import split_reasoning
from mtprun.data.templates.tool_calls import SYNTAXES, NoToolCalls, ToolCallSyntax

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_QUESTION = "mtprun probe question"
_REPLY = "mtprun probe reply"
_PROBE_CALL = ToolCall("mtprun_probe", {"argument": "probe value"})


@dataclass(frozen=True)
class TokenLabels:
    """A rendered conversation: token ids with, per token, its author and sampled flag, and
    (where the renderer knows it) the index of the message it renders, -1 for scaffolding
    outside every message."""

    token_ids: list[int]
    roles: list[Role]
    sampled: list[bool]
    message_indices: list[int] | None = None


@dataclass(frozen=True)
class _Encoded:
    text: str
    ids: list[int]
    starts: list[int]  # character offset where each token starts
    ends: list[int]  # ... and ends (made non-decreasing)


class ModelTemplate:
    """Per-token labels from a tokenizer's own chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        if not tokenizer.chat_template:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path or ''} has no chat template: set "
                "data.template / task.template, or give the model folder one"
            )
        self.tokenizer = tokenizer
        self.has_generation_blocks = bool(_GENERATION_BLOCK.search(tokenizer.chat_template))
        self._special_ids = _special_ids(tokenizer)
        self._preambles: dict[tuple[Role, str], list[int]] = {}
        self._prints_tools: bool | None = None
        self._check_prefix_stable()
        self.stop_token_ids: list[int] = sorted(_eos_ids(tokenizer) | self._turn_ends())
        self._stops = frozenset(self.stop_token_ids)
        self.tool_calls: ToolCallSyntax = self._tool_call_syntax()

    def label(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] = (),
    ) -> TokenLabels:
        tools = list(tools)
        if tools:
            self._check_prints_tools(tools)
        dicts = [m.to_dict() for m in messages]
        full = self._encode(self._render(dicts, add_generation_prompt, tools))
        bounds = self._message_bounds(messages, dicts, full, add_generation_prompt, tools)
        n = len(full.ids)
        roles: list[Role] = ["system"] * bounds[0]
        for message, (lo, hi) in zip(messages, itertools.pairwise(bounds), strict=True):
            roles += [message.role] * (hi - lo)
        roles += ["assistant"] * (n - bounds[-1])  # the generation prompt
        sampled = [False] * n
        if self.has_generation_blocks:
            spans = self._generation_spans(dicts, add_generation_prompt, n, tools)
        else:
            spans = self._emitted_spans(messages, dicts, full, bounds, tools)
        for lo, hi in spans:
            sampled[lo:hi] = [True] * (hi - lo)
            roles[lo:hi] = ["assistant"] * (hi - lo)
        return TokenLabels(full.ids, roles, sampled)

    def _message_bounds(
        self,
        messages: Sequence[Message],
        dicts: list[dict[str, Any]],
        full: _Encoded,
        add_generation_prompt: bool,
        tools: list[ToolSpec],
    ) -> list[int]:
        """Token index where each message starts, then where the last one ends (the
        generation prompt, if any, follows)."""
        bounds = [self._preamble_length(messages[0], full.ids, tools)]
        bounds += [
            self._agreement(self._render(dicts[:i], tools=tools), full)
            for i in range(1, len(dicts))
        ]
        bounds.append(
            self._agreement(self._render(dicts, tools=tools), full)
            if add_generation_prompt
            else len(full.ids)
        )
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            if hi < lo:
                raise ValueError(
                    f"the chat template of {self._name} is not prefix-stable: once message "
                    f"{i + 1} is added it renders messages before it differently, so its "
                    "tokens cannot be attributed to roles"
                )
        return bounds

    def parse_assistant(self, text: str, opened_reasoning: bool = False) -> Message:
        """The assistant message behind a generated turn's text: a leading `<think>` block
        its reasoning (`opened_reasoning`: the prompt opened it), its tool calls read with the
        template's syntax."""
        reasoning, answer = split_reasoning(self._without_stop(text), opened_reasoning)
        message = self.tool_calls.parse(answer)
        return Message("assistant", message.content, message.tool_calls, reasoning)

    def _check_prints_tools(self, tools: list[ToolSpec]) -> None:
        if self._prints_tools is None:
            probe = [Message("user", _QUESTION).to_dict()]
            self._prints_tools = self._render(probe, tools=tools) != self._render(probe)
        if not self._prints_tools:
            raise ValueError(
                f"the chat template of {self._name} prints no tool specs: a prompt with "
                "`tools` needs a template (or a `renderers` family) that shows them to the "
                "model; drop the dataset's tools column or use such a model folder"
            )

    def _without_stop(self, text: str) -> str:
        for stop in self.tokenizer.convert_ids_to_tokens(self.stop_token_ids):
            text = text.removesuffix(stop)
        return text

    @property
    def _name(self) -> str:
        return self.tokenizer.name_or_path or "this tokenizer"

    def _emitted_spans(
        self,
        messages: Sequence[Message],
        dicts: list[dict[str, Any]],
        full: _Encoded,
        bounds: list[int],
        tools: list[ToolSpec],
    ) -> list[tuple[int, int]]:
        """[start, end) of what the model emits in each assistant turn: after the generation
        prompt, through the first stop token (in the turn or the message after it)."""
        spans = []
        for i, message in enumerate(messages):
            if message.role != "assistant":
                continue
            opened = self._agreement(self._render(dicts[:i], True, tools), full) if i else bounds[0]
            start = min(max(opened, bounds[i]), bounds[i + 1])
            search_end = bounds[i + 2] if i + 2 < len(bounds) else len(full.ids)
            stop = next((k for k in range(start, search_end) if full.ids[k] in self._stops), None)
            spans.append((start, bounds[i + 1] if stop is None else stop + 1))
        return spans

    def _generation_spans(
        self, dicts: list[dict[str, Any]], add_generation_prompt: bool, n: int, tools: list[Any]
    ) -> list[tuple[int, int]]:
        encoded = self.tokenizer.apply_chat_template(
            dicts,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        mask = encoded["assistant_masks"]
        if len(mask) != n:
            raise ValueError(f"{self._name}: the generation mask does not match the tokens")
        return [(k, k + 1) for k, flag in enumerate(mask) if flag]

    def _agreement(self, prefix: str, full: _Encoded) -> int:
        """Tokens of `full` wholly inside its common prefix with the text `prefix`."""
        common = len(os.path.commonprefix([prefix, full.text]))  # noqa: RUF071 (text, not paths)
        return bisect_right(full.ends, common)

    def _preamble_length(self, first: Message, ids: list[int], tools: list[ToolSpec]) -> int:
        """Tokens before the first message's own rendering (system role), 0 for a system
        message (the template's preamble is then the system's anyway)."""
        if first.role == "system":
            return 0
        key = (first.role, json.dumps(tools, sort_keys=True))
        if key not in self._preambles:
            if len(self._preambles) >= 64:  # one per role and tool set: rows may each differ
                self._preambles.clear()
            self._preambles[key] = self._probe_preamble(first.role, tools)
        preamble = self._preambles[key]
        return len(preamble) if ids[: len(preamble)] == preamble else 0

    def _probe_preamble(self, role: Role, tools: list[ToolSpec]) -> list[int]:
        # The message's own rendering is what it adds as the third message of
        # [it, other, it]; whatever the template prints before it as the first is a preamble.
        probe = Message(role, _QUESTION)
        other = Message("user" if role == "assistant" else "assistant", _REPLY)
        try:
            alone = self._encode(self._render([probe.to_dict()], tools=tools))
            pair = self._render([probe.to_dict(), other.to_dict()], tools=tools)
            triple = self._encode(
                self._render([m.to_dict() for m in (probe, other, probe)], tools=tools)
            )
        except Exception:  # the template refuses the probe: assume no preamble
            return []
        own = triple.ids[self._agreement(pair, triple) :]
        if own and alone.ids[-len(own) :] == own:
            return alone.ids[: -len(own)]
        return []

    def _check_prefix_stable(self) -> None:
        """Each prefix of a probe conversation renders as the start of the whole one, up to
        past its last message at least (a trailer such as an EOS after a final turn may
        differ)."""
        messages = [
            Message(role, f"mtprun probe {i}")
            for i, role in enumerate(("user", "assistant", "user", "assistant"))
        ]
        dicts = [m.to_dict() for m in messages]
        try:
            whole = self._render(dicts)
        except Exception:  # the template refuses the probe: nothing to check it with
            return
        for i in range(1, len(dicts)):
            prefix = self._render(dicts[:i])
            content_end = prefix.find(messages[i - 1].content) + len(messages[i - 1].content)
            if len(os.path.commonprefix([prefix, whole])) < content_end:  # noqa: RUF071
                raise ValueError(
                    f"the chat template of {self._name} is not prefix-stable: the first {i} "
                    f"message(s) render differently once message {i + 1} follows, so tokens "
                    "cannot be attributed to the messages that wrote them"
                )

    def _turn_ends(self) -> set[int]:
        """The first special token the template prints after an assistant reply, for each
        message that may follow it (user, tool, none)."""
        ends = set()
        for following in (Message("user", _QUESTION), Message("tool", _QUESTION), None):
            messages = [Message("user", _QUESTION), Message("assistant", _REPLY)]
            try:
                text = self._render([m.to_dict() for m in [*messages, *filter(None, [following])]])
            except Exception:  # e.g. a template without tool messages
                continue
            reply_end = text.find(_REPLY) + len(_REPLY)
            if reply_end < len(_REPLY):
                continue  # the template does not print the reply as given
            encoded = self._encode(text)
            after = (
                token
                for token, start, end in zip(encoded.ids, encoded.starts, encoded.ends, strict=True)
                if start >= reply_end and text[start:end].strip()
            )
            token = next(after, None)
            if token in self._special_ids:
                ends.add(token)
        return ends

    def _tool_call_syntax(self) -> ToolCallSyntax:
        """The syntax that reads the template's rendering of a probe call back."""
        call = Message("assistant", "", (_PROBE_CALL,))
        messages = [Message("user", _QUESTION), call, Message("tool", _REPLY)]
        try:
            labels = self.label(messages, add_generation_prompt=False)
        except Exception:  # the template cannot render tool calls
            return NoToolCalls()
        emitted = [t for t, s in zip(labels.token_ids, labels.sampled, strict=True) if s]
        text = self._without_stop(self.tokenizer.decode(emitted))
        return next(
            (s for s in SYNTAXES if s.parse(text).tool_calls == call.tool_calls), NoToolCalls()
        )

    def _render(
        self,
        dicts: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[ToolSpec] = (),
    ) -> str:
        return self.tokenizer.apply_chat_template(
            dicts,
            tools=list(tools) or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _encode(self, text: str) -> _Encoded:
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        ends = list(itertools.accumulate((end for _, end in offsets), max, initial=0))[1:]
        return _Encoded(text, encoding["input_ids"], [start for start, _ in offsets], ends)


def _special_ids(tokenizer: Any) -> frozenset[int]:
    added = tokenizer.added_tokens_decoder
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def _eos_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's EOS and, for a model folder, its generation config's `eos_token_id`s."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    config = os.path.join(tokenizer.name_or_path or "", "generation_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids
