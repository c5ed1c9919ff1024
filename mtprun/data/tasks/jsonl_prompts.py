"""A task whose prompts and reference answers come from a `.jsonl` file.

One record per line: `{"messages": [...], "answer": "..."}`; the answer is what the reward
compares the model's final answer with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtprun.data.jsonl import Records, read_jsonl
from mtprun.data.messages import ConversationError, parse_conversation
from mtprun.data.tasks.base import Prompt, Task, rng_for


class JsonlPromptTask(Task):
    """Single-turn prompts from a file; `n` prompts are drawn in a seeded shuffled order,
    cycling through the file when `n` exceeds it."""

    def __init__(self, path: str | Path) -> None:
        self.name = str(path)
        self.file_prompts = read_prompts(path).records

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        order = list(range(len(self.file_prompts)))
        rng_for(self.name, seed).shuffle(order)
        return [self.file_prompts[order[i % len(order)]] for i in range(n)]


def read_prompts(path: str | Path) -> Records[Prompt]:
    """Every good prompt record of `path`; bad lines are reported as in `read_jsonl`."""
    return read_jsonl(path, _parse_prompt)


def _parse_prompt(record: Any) -> Prompt:
    messages = parse_conversation(record)
    answer = record.get("answer") if isinstance(record, dict) else None
    if not isinstance(answer, str):
        raise ConversationError('a prompt record needs a string "answer" for the reward')
    return Prompt(messages, answer)
