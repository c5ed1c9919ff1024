"""Located recipe diagnostics: every message points at `file:line:col` where it was written."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Position:
    """1-based line and column in a recipe file (or `<override N>` for a command-line override)."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    position: Position
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        tag = "warning: " if self.severity == "warning" else ""
        return f"{self.position}: {tag}{self.message}"


class RecipeError(Exception):
    """An invalid recipe; `diagnostics` lists every problem found, in file order."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(map(str, self.diagnostics)))


class RecipeWarning(UserWarning):
    """A recipe that is valid but probably not what was meant."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, or "" when none is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
