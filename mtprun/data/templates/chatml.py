"""ChatML as Qwen uses it: `<|im_start|>role\\n...<|im_end|>\\n`, tool calls in `<tool_call>`.

    <|im_start|>user
    What is 3*4?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name":"calculator","arguments":{"expression":"3*4"}}
    </tool_call><|im_end|>

The assistant's turn ends with its own `<|im_end|>` (sampled); the newline after it is not.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mtprun.data.messages import Message
from mtprun.data.templates.base import (
    JINJA_TOOL_CALL,
    NEWLINE,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatFormat,
    Piece,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

JINJA = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message.role }}" + NEWLINE + "{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if message.content or not loop.first -%}" + NEWLINE + "{%- endif -%}"
    "<tool_call>" + NEWLINE + JINJA_TOOL_CALL + NEWLINE + "</tool_call>"
    "{%- endfor -%}"
    "<|im_end|>" + NEWLINE + "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant" + NEWLINE + "{%- endif -%}"
)


class ChatMLFormat(ChatFormat):
    name = "chatml"
    special_tokens = (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    eos_token = IM_END
    stop_tokens = (IM_END,)
    jinja = JINJA

    def pieces(self, messages: Sequence[Message], add_generation_prompt: bool) -> Iterator[Piece]:
        for message in messages:
            role = message.role
            emitted = role == "assistant"
            yield Piece(f"{IM_START}{role}\n", role, False)
            yield Piece(message.content, role, emitted)
            for i, call in enumerate(message.tool_calls):
                separator = "\n" if message.content or i > 0 else ""
                markup = f"{separator}{TOOL_CALL_OPEN}\n{call.to_json()}\n{TOOL_CALL_CLOSE}"
                yield Piece(markup, role, emitted)
            yield Piece(IM_END, role, emitted)
            yield Piece("\n", role, False)
        if add_generation_prompt:
            yield Piece(f"{IM_START}assistant\n", "assistant", False)
