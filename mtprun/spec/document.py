"""YAML -> plain Python data plus the source position of every key and value.

Parsing uses ruamel.yaml's round-trip loader, which keeps positions and never constructs
Python objects from tags; explicit tags are rejected so a recipe is plain data only.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq, TaggedScalar
from ruamel.yaml.error import MarkedYAMLError

from mtprun.spec.errors import Diagnostic, Position, RecipeError

KeyPath = tuple[str | int, ...]
MAX_VALUES = 100_000  # far beyond any real recipe


@dataclass(frozen=True)
class Span:
    """Where a mapping entry's key and its value (or a list item) were written."""

    key: Position | None
    value: Position


@dataclass
class Document:
    """Recipe data with the span of every path (`("losses", 0, "weight")`) it holds."""

    data: Any
    spans: dict[KeyPath, Span] = field(default_factory=dict)

    def position(self, path: KeyPath, *, at_key: bool = False) -> Position:
        """Where `path` was written; its nearest written ancestor when it was not."""
        while path not in self.spans:
            path = path[:-1]
        span = self.spans[path]
        return span.key if at_key and span.key is not None else span.value

    def position_of(self, path: KeyPath) -> Position:
        """The value's position for scalars; the key's for mappings and lists (a section)."""
        return self.position(path, at_key=isinstance(self.get(path), dict | list))

    def get(self, path: KeyPath) -> Any:
        node = self.data
        for part in path:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return None
        return node


def display_name(path: os.PathLike[str] | str) -> str:
    """A file name for messages: relative to the working directory when inside it."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def read_document(path: FilePath) -> Document:
    """Parse the YAML file at `path`; unreadable files and YAML errors raise RecipeError."""
    name = display_name(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(
            [Diagnostic(Position(name, 1, 1), f"cannot read: {exc.strerror}")]
        ) from None
    return parse_document(text, name)


def parse_document(text: str, file: str, *, line: int = 1, col: int = 1) -> Document:
    """Parse YAML `text` found at `file:line:col` (overrides are parsed at an offset)."""
    try:
        tree = YAML(typ="rt").load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = Position(file, line + mark.line, (col if mark.line == 0 else 1) + mark.column)
        problem = " ".join(str(exc.problem or exc.context).split())
        raise RecipeError([Diagnostic(at, f"YAML syntax error: {problem}")]) from None
    doc = Document(None, {(): Span(None, Position(file, line, col))})
    errors: list[Diagnostic] = []
    budget = [MAX_VALUES]

    def at(line0: int, col0: int) -> Position:
        return Position(file, line + line0, (col if line0 == 0 else 1) + col0)

    def convert(node: Any, path: KeyPath) -> Any:
        budget[0] -= 1
        if budget[0] < 0:  # aliases of aliases can expand exponentially ("billion laughs")
            message = f"the recipe expands to more than {MAX_VALUES} values (nested YAML aliases?)"
            raise RecipeError([Diagnostic(doc.position(()), message)])
        tag = getattr(getattr(node, "tag", None), "value", None)
        if isinstance(node, TaggedScalar) or tag is not None:
            errors.append(
                Diagnostic(
                    doc.position(path),
                    f"YAML tag '{tag}' is not allowed: recipes are plain data (remove the tag)",
                )
            )
            return None
        if isinstance(node, CommentedMap):
            out = {}
            for key, value in node.items():
                name = key if isinstance(key, str) else str(key)
                key_at, value_at = _entry_position(node, key)
                doc.spans[(*path, name)] = Span(at(*key_at), at(*value_at))
                out[name] = convert(value, (*path, name))
            return out
        if isinstance(node, CommentedSeq):
            items = []
            for i, value in enumerate(node):
                doc.spans[(*path, i)] = Span(None, at(*node.lc.item(i)))
                items.append(convert(value, (*path, i)))
            return items
        return _plain_scalar(node)

    doc.data = convert(tree, ())
    if errors:
        raise RecipeError(errors)
    return doc


def _entry_position(node: CommentedMap, key: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """0-based (line, col) of a mapping entry's key and value; an entry brought in by a merge
    key (`<<: *base`) is found where the merged mapping wrote it."""
    for source in _merge_sources(node):
        if key in source.lc.data:
            return source.lc.key(key), source.lc.value(key)
    return (node.lc.line, node.lc.col), (node.lc.line, node.lc.col)


def _merge_sources(node: CommentedMap) -> Iterator[CommentedMap]:
    yield node
    for merged in getattr(node, "merge", ()):
        yield from _merge_sources(merged)


def _plain_scalar(value: Any) -> Any:
    # ruamel's round-trip scalars subclass the builtins; hand plain ones to pydantic.
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, datetime.date):
        return value.isoformat()
    return str(value)
