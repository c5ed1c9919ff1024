"""What a chat template family knows beyond its Jinja text: who emits which piece."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from mtprun.data.messages import Message, Role
from mtprun.data.templates.reasoning import split_reasoning
from mtprun.data.templates.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TaggedJson

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ChatFormat", "Piece"]

# A newline in the Jinja templates. Literal newlines next to block tags are eaten by the
# whitespace control (`-%}`) and by transformers' trim_blocks, so they are printed explicitly.
NEWLINE = "{{ '\\n' }}"

# Jinja for one tool call, identical to ToolCall.to_json(): compact JSON, argument keys sorted.
# Arguments given as a string (OpenAI wire form) are printed as they are.
JINJA_TOOL_CALL = (
    "{%- set fn = call.function if call.function is defined else call -%}"
    '{"name":{{ fn.name | tojson }},"arguments":'
    "{%- if fn.arguments is string -%}{{ fn.arguments }}"
    "{%- else -%}{{ fn.arguments | tojson(separators=(',', ':'), sort_keys=True) }}{%- endif -%}"
    "}"
)


@dataclass(frozen=True)
class Piece:
    """A run of text with one author role, either emitted by the model (sampled) or not."""

    text: str
    role: Role
    sampled: bool


class ChatFormat(ABC):
    """A chat template family: its special tokens, its Jinja template, and a Python renderer
    that yields the same text as the Jinja one, split into pieces labelled with the role that
    authored them and whether the model emits them at inference.

    Subclasses set the class attributes and implement `pieces`.
    """

    name: str
    special_tokens: tuple[str, ...]
    eos_token: str
    # Every token at which the rollout engine must stop a turn.
    stop_tokens: tuple[str, ...]
    jinja: str

    @abstractmethod
    def pieces(self, messages: Sequence[Message], add_generation_prompt: bool) -> Iterator[Piece]:
        """The rendering of `messages`, in order; joined, exactly the Jinja template's text."""

    def parse_assistant(self, text: str, opened_reasoning: bool = False) -> Message:
        """The assistant message behind generated text (stop token stripped or not).

        A leading `<think>...</think>` block is the message's reasoning (`reasoning.py`;
        `opened_reasoning`: the prompt opened it). Tool calls are
        `<tool_call>{json}</tool_call>` in every shipped family; a call whose JSON does not
        parse is kept as content, so a reward sees the malformed text.
        """
        for stop in self.stop_tokens:
            text = text.removesuffix(stop)
        reasoning, answer = split_reasoning(text, opened_reasoning)
        return replace(TaggedJson().parse(answer), reasoning_content=reasoning)
