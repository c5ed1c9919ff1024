"""`extends:` recipe inheritance: bases are deep-merged under the extending file."""

from __future__ import annotations

from pathlib import Path as FilePath
from typing import Any

from mtprun.spec.document import Document, KeyPath, display_name, read_document
from mtprun.spec.errors import Diagnostic, RecipeError


def load_with_extends(path: FilePath, chain: tuple[FilePath, ...] = ()) -> Document:
    """Read `path` and everything it extends (relative to it), bases first, merged."""
    path = path.resolve()
    doc = read_document(path)
    if not isinstance(doc.data, dict):
        raise RecipeError(
            [Diagnostic(doc.position(()), "a recipe is a mapping of sections (name:, model:, ...)")]
        )
    if "extends" not in doc.data:
        return doc
    merged: Document | None = None
    for base_path, where in _base_paths(doc, path):
        if base_path in (*chain, path):
            cycle = " -> ".join(display_name(p) for p in (*chain, path, base_path))
            raise RecipeError([Diagnostic(doc.position(where), f"extends cycle: {cycle}")])
        if not base_path.is_file():
            raise RecipeError(
                [Diagnostic(doc.position(where), f"extended file not found: {base_path}")]
            )
        base = load_with_extends(base_path, (*chain, path))
        merged = base if merged is None else merge(merged, base)
    own = _without(doc, "extends")
    return own if merged is None else merge(merged, own)


def _base_paths(doc: Document, path: FilePath) -> list[tuple[FilePath, KeyPath]]:
    value = doc.data["extends"]
    names = value if isinstance(value, list) else [value]
    out = []
    for i, name in enumerate(names):
        where: KeyPath = ("extends", i) if isinstance(value, list) else ("extends",)
        if not isinstance(name, str) or not name:
            message = "extends takes a file name or a list of file names, relative to this file"
            raise RecipeError([Diagnostic(doc.position(where), message)])
        out.append(((path.parent / name).resolve(), where))
    return out


def _without(doc: Document, key: str) -> Document:
    data = {k: v for k, v in doc.data.items() if k != key}
    spans = {p: s for p, s in doc.spans.items() if p[:1] != (key,)}
    return Document(data, spans)


def merge(base: Document, over: Document) -> Document:
    """Deep-merge `over` onto `base`: mappings merge key by key, anything else replaces.

    Spans follow the data: a replaced value keeps none of the base's spans beneath it.
    """
    replaced: list[KeyPath] = []

    def merge_data(b: Any, o: Any, path: KeyPath) -> Any:
        if isinstance(b, dict) and isinstance(o, dict):
            out = dict(b)
            for key, value in o.items():
                out[key] = merge_data(b[key], value, (*path, key)) if key in b else value
            return out
        replaced.append(path)
        return o

    data = merge_data(base.data, over.data, ())
    spans = {p: s for p, s in base.spans.items() if not any(p[: len(r)] == r for r in replaced)}
    spans.update({p: s for p, s in over.spans.items() if p != ()})
    spans[()] = over.spans[()]
    return Document(data, spans)
