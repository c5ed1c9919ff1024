"""How the CLI prints recipe diagnostics: one `file:line:col: message` line each, on stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from mtprun.spec import Diagnostic

EXIT_INVALID = 2


def print_diagnostics(diagnostics: Iterable[Diagnostic]) -> None:
    for diagnostic in diagnostics:
        print(diagnostic, file=sys.stderr)


def split_overrides(args: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split positional arguments into recipe files and KEY=VALUE overrides."""
    files, overrides = [], []
    for arg in args:
        is_file = arg.endswith((".yaml", ".yml")) or "=" not in arg
        (files if is_file else overrides).append(arg)
    return files, overrides
