"""GLM-style: a message opens with its role tag and has no closing token.

    <|user|>
    What is 3*4?<|assistant|>
    <tool_call>{"name":"calculator","arguments":{"expression":"3*4"}}</tool_call><|observation|>
    ...tool output...<|assistant|>
    12<|endoftext|>

The model ends its turn by emitting the NEXT message's opening tag (`<|observation|>` before a
tool result, `<|user|>` before a user message): the template files that stop token under the
next message, but the assistant sampled it, so it is attributed to the assistant and trained.
A conversation that ends on an assistant turn closes it with `<|endoftext|>`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mtprun.data.messages import Message, Role
from mtprun.data.templates.base import (
    JINJA_TOOL_CALL,
    NEWLINE,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatFormat,
    Piece,
)

EOS = "<|endoftext|>"
OPENING_TAGS: dict[Role, str] = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|observation|>",
}

JINJA = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}<|observation|>"
    "{%- else -%}<|{{ message.role }}|>{%- endif -%}" + NEWLINE + "{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] -%}"
    "<tool_call>" + JINJA_TOOL_CALL + "</tool_call>"
    "{%- endfor -%}"
    "{%- endfor -%}"
    "{%- if messages and messages[-1].role == 'assistant' -%}<|endoftext|>{%- endif -%}"
    "{%- if add_generation_prompt -%}<|assistant|>" + NEWLINE + "{%- endif -%}"
)


class GLMFormat(ChatFormat):
    name = "glm"
    special_tokens = (*OPENING_TAGS.values(), EOS, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    eos_token = EOS
    stop_tokens = ("<|user|>", "<|observation|>", EOS)
    jinja = JINJA

    def pieces(self, messages: Sequence[Message], add_generation_prompt: bool) -> Iterator[Piece]:
        previous: Role | None = None
        for message in messages:
            role = message.role
            if previous == "assistant":
                # The stop token of the previous assistant turn.
                yield Piece(OPENING_TAGS[role], "assistant", True)
            else:
                yield Piece(OPENING_TAGS[role], role, False)
            yield Piece("\n", role, False)
            emitted = role == "assistant"
            yield Piece(message.content, role, emitted)
            for call in message.tool_calls:
                yield Piece(TOOL_CALL_OPEN + call.to_json() + TOOL_CALL_CLOSE, role, emitted)
            previous = role
        if previous == "assistant":
            yield Piece(EOS, "assistant", True)
        if add_generation_prompt:
            yield Piece(OPENING_TAGS["assistant"] + "\n", "assistant", False)
