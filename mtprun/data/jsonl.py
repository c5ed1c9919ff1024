"""JSON-lines files of records (SFT conversations, RL prompts), one record per line.

A bad line does not cost the good ones: each is reported as `file:line: reason` and skipped,
and the caller gets every good record plus the full list of bad lines.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from mtprun.data.messages import Conversation, parse_conversation

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DataFileError(ValueError):
    """A data file cannot be used at all (missing, or not one good record)."""


@dataclass(frozen=True)
class RecordError:
    path: Path
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class Records(Generic[T]):
    """The good records of a file, and one error per bad line, in file order."""

    records: list[T] = field(default_factory=list)
    errors: list[RecordError] = field(default_factory=list)


def read_jsonl(path: str | Path, parse: Callable[[Any], T]) -> Records[T]:
    """Parse every non-blank line of `path` with `parse` (which raises ValueError on a bad
    record). Bad lines are logged and skipped; raises DataFileError when none is good."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DataFileError(f"cannot read data file {path}: {err.strerror}") from err
    out: Records[T] = Records()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.records.append(parse(json.loads(line)))
        except json.JSONDecodeError as err:
            out.errors.append(RecordError(path, number, f"not valid JSON: {err.msg}"))
        except ValueError as err:
            out.errors.append(RecordError(path, number, str(err)))
    for error in out.errors:
        logger.warning("skipping bad record %s", error)
    if not out.records:
        details = "".join(f"\n  {e}" for e in out.errors) or " (the file is empty)"
        raise DataFileError(f"no usable record in {path}:{details}")
    return out


def read_conversations(path: str | Path) -> Records[Conversation]:
    """SFT conversations: `{"messages": [{"role", "content", "tool_calls"?}, ...]}` per line."""
    return read_jsonl(path, parse_conversation)
