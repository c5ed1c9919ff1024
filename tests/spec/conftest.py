"""Fixtures: recipe files written into tmp_path, and their diagnostics as text lines."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from mtprun.preflight import check_recipe

# A minimal valid SFT recipe; tests append sections after its 9 lines.
BASE = """\
name: t
model:
  tiny:
    hidden: 128
    heads: 2
    kv_heads: 1
data:
  source: arithmetic
  template: char
"""

WriteRecipe = Callable[..., Path]


@pytest.fixture
def write_recipe(tmp_path: Path) -> WriteRecipe:
    """write_recipe(text, name="r.yaml") -> path; text is dedented."""

    def write(text: str, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write


@pytest.fixture
def base_recipe() -> str:
    return BASE


def _located(path: Path, overrides: Sequence[str] = ()) -> list[str]:
    return [str(d) for d in check_recipe(path, overrides).diagnostics]


@pytest.fixture
def located() -> Callable[..., list[str]]:
    """located(path, overrides=()) -> every diagnostic as a `file:line:col: message` line."""
    return _located
