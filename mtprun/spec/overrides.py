"""Command-line overrides: `trainer.lr=3e-5 losses.0.weight=0.5 mask=all`.

KEY is a dotted path (list items by index; index == length appends an item); VALUE is YAML
(`[1, 2]`, `{kind: ce}`, `null`), typed later through the recipe schema like file values.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from mtprun.spec.document import Document, KeyPath, Span, parse_document
from mtprun.spec.errors import Diagnostic, Position, RecipeError


def apply_overrides(doc: Document, overrides: Sequence[str]) -> Document:
    """`doc` with every override applied in order; all bad overrides reported at once."""
    doc = Document(copy.deepcopy(doc.data), dict(doc.spans))
    errors: list[Diagnostic] = []
    for n, text in enumerate(overrides, start=1):
        try:
            _apply(doc, text, f"<override {n}>")
        except RecipeError as exc:
            errors.extend(exc.diagnostics)
    if errors:
        raise RecipeError(errors)
    return doc


def _apply(doc: Document, text: str, file: str) -> None:
    key, eq, raw = text.partition("=")
    start = Position(file, 1, 1)
    if not eq or not key:
        raise _error(start, f"expected KEY=VALUE (e.g. trainer.lr=3e-5), got {text!r}")
    parts = key.split(".")
    if "" in parts:
        raise _error(start, f"empty segment in key {key!r}")
    if parts[0] == "extends":
        raise _error(start, "extends cannot be overridden; edit the recipe")
    value_col = len(key) + 2
    value = parse_document(raw, file, col=value_col) if raw.strip() else None
    parent, path = _walk_to_parent(doc, parts, start)
    last = _segment(parent, parts[-1], path, start)
    target = (*path, last)
    if isinstance(parent, list) and last == len(parent):
        parent.append(None)
    parent[last] = value.data if value else None
    doc.spans = {p: s for p, s in doc.spans.items() if p[: len(target)] != target}
    doc.spans[target] = Span(start, Position(file, 1, value_col))
    if value:
        doc.spans.update({(*target, *p): s for p, s in value.spans.items() if p})


def _walk_to_parent(
    doc: Document, parts: list[str], start: Position
) -> tuple[dict[str, Any] | list[Any], KeyPath]:
    node: Any = doc.data
    path: KeyPath = ()
    for part in parts[:-1]:
        seg = _segment(node, part, path, start)
        if isinstance(node, list) and seg == len(node):
            node.append(None)
        child = node.get(seg) if isinstance(node, dict) else node[seg]
        if child is None:  # an absent or null section: create it
            child = node[seg] = {}
            doc.spans[(*path, seg)] = Span(start, start)
        elif not isinstance(child, dict | list):
            dotted = ".".join(map(str, (*path, seg)))
            raise _error(
                start, f"cannot set a key inside '{dotted}': it is {child!r}, not a mapping"
            )
        node, path = child, (*path, seg)
    return node, path


def _segment(
    node: dict[str, Any] | list[Any], part: str, path: KeyPath, start: Position
) -> str | int:
    if isinstance(node, dict):
        return part
    dotted = ".".join(map(str, path))
    if not part.isdigit() or int(part) > len(node):  # index == length appends an item
        raise _error(
            start, f"'{dotted}' is a list of {len(node)}; index {part!r} is not in 0..{len(node)}"
        )
    return int(part)


def _error(at: Position, message: str) -> RecipeError:
    return RecipeError([Diagnostic(at, message)])
