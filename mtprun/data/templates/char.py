"""The tiny template of the CPU recipes: one special token per role, `<|end|>` closes a turn.

    <|user|>12+7=<|end|><|assistant|>19<|end|>

Short on purpose: with a character-level vocabulary every markup character costs a token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mtprun.data.messages import Message
from mtprun.data.templates.base import (
    JINJA_TOOL_CALL,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatFormat,
    Piece,
)

END = "<|end|>"

JINJA = (
    "{%- for message in messages -%}"
    "<|{{ message.role }}|>{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] -%}"
    "<tool_call>" + JINJA_TOOL_CALL + "</tool_call>"
    "{%- endfor -%}"
    "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


class CharFormat(ChatFormat):
    name = "char"
    special_tokens = (
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
        END,
        TOOL_CALL_OPEN,
        TOOL_CALL_CLOSE,
    )
    eos_token = END
    stop_tokens = (END,)
    jinja = JINJA

    def pieces(self, messages: Sequence[Message], add_generation_prompt: bool) -> Iterator[Piece]:
        for message in messages:
            role = message.role
            # The model writes everything of its own turn after the role tag, `<|end|>` included.
            emitted = role == "assistant"
            yield Piece(f"<|{role}|>", role, False)
            yield Piece(message.content, role, emitted)
            for call in message.tool_calls:
                yield Piece(TOOL_CALL_OPEN + call.to_json() + TOOL_CALL_CLOSE, role, emitted)
            yield Piece(END, role, emitted)
        if add_generation_prompt:
            yield Piece("<|assistant|>", "assistant", False)
