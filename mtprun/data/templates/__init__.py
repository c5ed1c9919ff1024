"""The chat template families mtprun renders with exact per-token sampled flags."""

from __future__ import annotations

from mtprun.data.templates.base import ChatFormat, Piece
from mtprun.data.templates.char import CharFormat
from mtprun.data.templates.chatml import ChatMLFormat
from mtprun.data.templates.glm import GLMFormat

CHAT_FORMATS: dict[str, ChatFormat] = {
    f.name: f for f in (CharFormat(), ChatMLFormat(), GLMFormat())
}


def get_chat_format(name: str) -> ChatFormat:
    """The chat format called `name` (the recipe's `data.template`)."""
    try:
        return CHAT_FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(CHAT_FORMATS))
        raise ValueError(f"unknown chat template {name!r}: expected one of {known}") from None


def chat_format_of_template(chat_template: str | None) -> ChatFormat | None:
    """The known format whose Jinja text is exactly `chat_template`, else None."""
    return next((f for f in CHAT_FORMATS.values() if f.jinja == chat_template), None)


__all__ = ["CHAT_FORMATS", "ChatFormat", "Piece", "chat_format_of_template", "get_chat_format"]
