"""Dataset rows -> RL prompts and SFT conversations, through a recipe's column mapping.

A prompt row has the prompt in a `prompt` column (a string: one user message; or a list of
messages) or a conversation in a `messages` column, and optionally a reference `answer`
(a string or a number), and optionally the tools the model may call in a `tools` column (a
list of OpenAI-style tool specs, or JSON text holding one: the chat template prints them; see
`messages.parse_tools`). Every column of the row is kept as the prompt's record, which the
reward receives. `PromptDataset` keeps only the indices of the good rows; the rows stay in
the memory-mapped table and are read when a step draws them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mtprun.data.dataset_files import DataFileError, RecordError, Table, open_table, scan
from mtprun.data.messages import (
    TOOLS_COLUMN,
    Conversation,
    ConversationError,
    Message,
    Prompt,
    ToolSpec,
    parse_conversation,
    parse_tools,
)

if TYPE_CHECKING:
    from mtprun.spec.data import ColumnMap, DatasetSpec


class PromptDataset:
    """The good rows of a prompt dataset, split into training and held-out rows.

    Training prompts form a stream of epochs: epoch e visits every training row once, in an
    order drawn from (seed, e) (file order without `shuffle`). The prompts of a step are a
    pure function of (seed, step), so a resumed run draws exactly what it would have drawn.
    """

    def __init__(self, spec: DatasetSpec, seed: int, cache_dir: str | Path | None = None):
        self.spec = spec
        self.seed = seed
        self.table = open_table(spec.path, cache_dir)
        self._parse = _prompt_parser(spec.columns, self.table.columns)
        rows, self.errors = scan(self.table, self._parse, _read_columns(spec.columns, self.table))
        held = spec.heldout_rows(len(rows))
        if held >= len(rows):
            raise DataFileError(
                f"{spec.path}: heldout {spec.heldout} leaves no training row of {len(rows)} "
                "good rows"
            )
        pick = np.random.default_rng([seed, 0x5E1D]).permutation(len(rows))
        self.heldout_rows = np.sort(rows[pick[:held]])
        self.train_rows = np.sort(rows[pick[held:]])
        self._epoch_orders: dict[int, np.ndarray] = {}

    def prompt(self, row: int) -> Prompt:
        return self._parse(self.table.record(row))

    def stream(self, start: int, count: int) -> list[Prompt]:
        """Prompts `start .. start+count-1` of the training stream."""
        size = len(self.train_rows)
        out = []
        for position in range(start, start + count):
            epoch, index = divmod(position, size)
            out.append(self.prompt(int(self.train_rows[self._order(epoch)[index]])))
        return out

    def heldout(self, limit: int | None = None) -> list[Prompt]:
        rows = self.heldout_rows if limit is None else self.heldout_rows[:limit]
        return [self.prompt(int(r)) for r in rows]

    def sample(self, n: int, seed: int) -> list[Prompt]:
        """`n` training prompts in an order drawn from `seed`, cycling when n exceeds them."""
        order = np.random.default_rng([seed, 0x5A3F]).permutation(len(self.train_rows))
        return [self.prompt(int(self.train_rows[order[i % len(order)]])) for i in range(n)]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_orders:
            size = len(self.train_rows)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(size)
                if self.spec.shuffle
                else np.arange(size)
            )
            self._epoch_orders = {epoch: order}  # one epoch's order at a time in memory
        return self._epoch_orders[epoch]


class ConversationDataset(Sequence[Conversation]):
    """The good rows of an SFT dataset as conversations, in file order (a seeded shuffle is
    the SFT source's, per epoch). As in `PromptDataset` only the good rows' indices stay in
    memory; a conversation is parsed from the memory-mapped table when it is asked for."""

    def __init__(self, spec: DatasetSpec, cache_dir: str | Path | None = None):
        self.spec = spec
        self.table = open_table(spec.path, cache_dir)
        self._parse = _conversation_parser(spec.columns, self.table.columns)
        self.rows, self.errors = scan(
            self.table, self._parse, _read_columns(spec.columns, self.table)
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Conversation:  # type: ignore[override]
        return self._parse(self.table.record(int(self.rows[index])))

    def example(self, index: int) -> tuple[Conversation, tuple[ToolSpec, ...]]:
        """Conversation `index` and its tool specs (its row's `tools` column; none without),
        which the chat template prints before it."""
        record = self.table.record(int(self.rows[index]))
        return self._parse(record), parse_tools(record.get(TOOLS_COLUMN))

    def where(self, index: int, reason: str) -> RecordError:
        """The error of conversation `index`, located in its file."""
        return self.table.where(int(self.rows[index]), reason)

    @property
    def fingerprint(self) -> str:
        """Changes when the conversations may: the files read or the column mapping."""
        described = json.dumps([self.table.fingerprint, self.spec.columns.model_dump(mode="json")])
        return hashlib.sha256(described.encode()).hexdigest()


def _read_columns(columns: ColumnMap, table: Table) -> list[str] | None:
    """The columns a scan needs (the others are never read while scanning); raises
    DataFileError when the table lacks the prompt column or a named answer column."""
    if table.is_jsonl:
        return None
    names = table.columns
    prompt, _ = _prompt_column(columns, names)
    wanted = [prompt] + ([columns.answer] if columns.answer != "answer" else [])
    for column in wanted:
        if column not in names:
            raise DataFileError(
                f'{table.path}: no "{column}" column (columns: {", ".join(map(repr, names))}); '
                "name the dataset's columns with columns: {prompt: NAME} or {messages: NAME}, "
                "and {answer: NAME}"
            )
    read = (columns.prompt, columns.messages, columns.answer, "prompt", "messages", TOOLS_COLUMN)
    return [c for c in read if c]


def _prompt_column(columns: ColumnMap, names: list[str] | dict[str, Any]) -> tuple[str, bool]:
    """(column, holds a conversation) of the prompt, given the table's column names (or a
    .jsonl record, whose keys are its own)."""
    if columns.prompt is not None:
        return columns.prompt, False
    if columns.messages is not None:
        return columns.messages, True
    if "prompt" in names and "messages" not in names:
        return "prompt", False
    return "messages", True


def _prompt_parser(columns: ColumnMap, names: list[str]) -> Any:
    def parse(record: dict[str, Any]) -> Prompt:
        column, is_conversation = _prompt_column(columns, names or record)
        messages = _messages(record, column, is_conversation)
        tools = parse_tools(record.get(TOOLS_COLUMN))
        return Prompt(messages, _answer(record, columns.answer), record, tools)

    return parse


def _conversation_parser(columns: ColumnMap, names: list[str]) -> Any:
    def parse(record: dict[str, Any]) -> Conversation:
        column, is_conversation = _prompt_column(columns, names or record)
        messages = _messages(record, column, is_conversation)
        parse_tools(record.get(TOOLS_COLUMN))  # a bad row is reported when scanned
        if is_conversation:
            return messages
        answer = _answer(record, columns.answer)
        if answer is None:
            raise ConversationError(
                f'an SFT row with a "{column}" column needs an "{columns.answer}" column for '
                "the assistant's reply"
            )
        return (*messages, Message("assistant", answer))

    return parse


def _messages(record: dict[str, Any], column: str, is_conversation: bool) -> Conversation:
    if column not in record:
        present = ", ".join(map(repr, record)) or "none"
        raise ConversationError(
            f'no "{column}" column (columns: {present}); name the prompt column with '
            "columns: {prompt: NAME} or {messages: NAME}"
        )
    value = record[column]
    if isinstance(value, str) and is_conversation:
        try:  # a conversation stored as JSON text (csv files)
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConversationError(f'"{column}" is not a list of messages: {err.msg}') from None
    if isinstance(value, str):
        if not value:
            raise ConversationError(f'"{column}" is an empty prompt')
        return (Message("user", value),)
    if value is None:
        raise ConversationError(f'"{column}" is null')
    return parse_conversation({"messages": value})


def _answer(record: dict[str, Any], column: str) -> str | None:
    if column not in record:
        return None
    value = record[column]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        kind = "null" if value is None else type(value).__name__
        raise ConversationError(f'"{column}" must be a string or a number, got {kind}')
    return str(value)
