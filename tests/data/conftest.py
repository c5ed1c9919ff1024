from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
import torch

from mtprun.data.messages import Conversation, Message, ToolCall
from mtprun.data.render import Renderer
from mtprun.data.tokenizer import build_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEMPLATES = ("char", "chatml", "glm")


@pytest.fixture(scope="session", params=TEMPLATES)
def template(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def renderer(template: str) -> Renderer:
    return Renderer(build_tokenizer(template))


@pytest.fixture
def tool_conversation() -> Conversation:
    """system, user, assistant tool call, long tool output, assistant answer, user, assistant."""
    return (
        Message("system", "Use tools."),
        Message("user", "What is 3*4?"),
        Message("assistant", "", (ToolCall("calculator", {"expression": "3*4"}),)),
        Message("tool", "result: 12\n" * 5),
        Message("assistant", "12"),
        Message("user", "Thanks"),
        Message("assistant", "You're welcome."),
    )


@pytest.fixture
def random_conversation() -> Callable[[random.Random], Conversation]:
    return make_random_conversation


def make_random_conversation(rng: random.Random) -> Conversation:
    """A fresh conversation of random roles, texts (printable ASCII, newlines) and calls."""
    alphabet = "".join(chr(c) for c in range(32, 127)) + "\n"

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))

    messages = []
    if rng.random() < 0.5:
        messages.append(Message("system", text()))
    for _ in range(rng.randint(1, 4)):
        messages.append(Message("user", text()))
        calls = tuple(
            ToolCall(text() or "f", {text(): rng.randint(-9, 9), "s": text()})
            for _ in range(rng.choice([0, 0, 1, 2]))
        )
        messages.append(Message("assistant", text(), calls))
        if calls:
            messages.append(Message("tool", text()))
            messages.append(Message("assistant", text()))
    if rng.random() < 0.5:
        messages.append(Message("user", text()))
    return tuple(messages)


def sampled_runs(is_sampled: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens."""
    flags = is_sampled.tolist()
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs
