"""pydantic validation errors -> located, readable diagnostics."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from mtprun.losses import KINDS, TRUNK_KINDS
from mtprun.spec.document import Document, KeyPath
from mtprun.spec.errors import Diagnostic, did_you_mean
from mtprun.spec.recipe import Recipe

ROOT_ONLY_KEYS = ("extends",)  # read by the loader, never reaches the schema


def validation_diagnostics(exc: ValidationError, doc: Document) -> list[Diagnostic]:
    """One located diagnostic per pydantic error of validating `doc.data` as a Recipe."""
    return [_diagnostic(error, doc) for error in exc.errors(include_url=False)]


Handler = Callable[[ErrorDetails, KeyPath, bool, Document], Diagnostic]


def _diagnostic(error: ErrorDetails, doc: Document) -> Diagnostic:
    path, at_key = _data_path(error["loc"], doc.data)
    handler = _HANDLERS.get(error["type"], _generic)
    return handler(error, path, at_key, doc)


def _unknown_key(error: ErrorDetails, path: KeyPath, at_key: bool, doc: Document) -> Diagnostic:
    key = str(path[-1])
    section = f" in '{_dotted(path[:-1])}'" if len(path) > 1 else ""
    hint = did_you_mean(key, _known_keys(path[:-1], doc))
    return Diagnostic(doc.position(path, at_key=True), f"unknown key '{key}'{section}{hint}")


def _missing(error: ErrorDetails, path: KeyPath, at_key: bool, doc: Document) -> Diagnostic:
    # `path` is the section holding the missing key: point at that section's key.
    section = f" in '{_dotted(path)}'" if path else ""
    message = f"missing required key '{error['loc'][-1]}'{section}"
    return Diagnostic(doc.position(path, at_key=True), message)


def _literal(error: ErrorDetails, path: KeyPath, at_key: bool, doc: Document) -> Diagnostic:
    allowed = re.findall(r"'([^']*)'", error["ctx"]["expected"])
    got = error["input"]
    hint = did_you_mean(got, allowed) if isinstance(got, str) else ""
    what = f"{_dotted(path[:-1])}: invalid key" if at_key else f"{_dotted(path)}: invalid value"
    message = f"{what} {got!r}{hint}; allowed: {', '.join(repr(a) for a in allowed)}"
    if path == ("mask",):
        message += ", or a roles table such as {assistant: true, tool: false}"
    return Diagnostic(doc.position(path, at_key=at_key), message)


def _loss_kind(error: ErrorDetails, path: KeyPath, at_key: bool, doc: Document) -> Diagnostic:
    # The only discriminated union of models in a recipe is a loss term's `kind`.
    kinds = KINDS + TRUNK_KINDS
    choices = ", ".join(kinds)
    if error["type"] == "union_tag_not_found":
        message = f"{_dotted(path)}: a loss term needs `kind:` (one of {choices})"
        return Diagnostic(doc.position_of(path), message)
    tag = str(error["ctx"]["tag"])
    hint = did_you_mean(tag, kinds)
    message = f"{_dotted(path)}: unknown loss kind '{tag}'{hint}; allowed: {choices}"
    return Diagnostic(doc.position((*path, "kind")), message)


def _pattern(error: ErrorDetails, path: KeyPath, at_key: bool, doc: Document) -> Diagnostic:
    if path != ("name",):
        return _generic(error, path, at_key, doc)
    message = f"name: {error['input']!r} is not a run name: use letters, digits, '.', '_', '-'"
    return Diagnostic(doc.position(path), message)


def _generic(error: ErrorDetails, path: KeyPath, at_key: bool, doc: Document) -> Diagnostic:
    message = error["msg"].removeprefix("Value error, ")
    message = message[0].lower() + message[1:]
    got = error["input"]
    if not isinstance(got, dict | list) and error["type"] != "value_error":
        message += f" (got {got!r})"
    where = doc.position(path, at_key=True) if at_key else doc.position_of(path)
    return Diagnostic(where, f"{_dotted(path)}: {message}")


_HANDLERS: dict[str, Handler] = {
    "extra_forbidden": _unknown_key,
    "missing": _missing,
    "literal_error": _literal,
    "union_tag_invalid": _loss_kind,
    "union_tag_not_found": _loss_kind,
    "string_pattern_mismatch": _pattern,
}


def _data_path(loc: tuple[str | int, ...], data: Any) -> tuple[KeyPath, bool]:
    """The path in the recipe data that a pydantic `loc` names, and whether it is a key.

    pydantic adds union branch tags to `loc` (`losses.0.grpo.clip_low`, `mask.roles`); those
    are not in the data and are skipped.
    """
    path: list[str | int] = []
    node = data
    for i, part in enumerate(loc):
        if part == "[key]":
            return tuple(path), True
        is_branch_tag = i > 0 and isinstance(loc[i - 1], int) and _kind_of(node) == part
        if (isinstance(node, dict) and part in node and not is_branch_tag) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            node = node[part]
        else:  # a union branch tag, or a key the data lacks (missing)
            continue
        path.append(part)
    return tuple(path), False


def _kind_of(node: Any) -> Any:
    return node.get("kind") if isinstance(node, dict) else None


def _known_keys(path: KeyPath, doc: Document) -> list[str]:
    """Field names of the section at `path` (for "did you mean")."""
    models: list[type[BaseModel]] = [Recipe]
    for i, part in enumerate(path):
        if isinstance(part, int):
            continue
        model = _pick(models, doc.get(path[:i]))
        field = model.model_fields.get(part) if model else None
        if field is None:
            return []
        models = list(_models_in(field.annotation))
    model = _pick(models, doc.get(path))
    if model is None:
        return []
    names = list(model.model_fields)
    return [*names, *ROOT_ONLY_KEYS] if not path else names


def _pick(models: list[type[BaseModel]], node: Any) -> type[BaseModel] | None:
    if len(models) == 1:
        return models[0]
    kind = _kind_of(node)
    if kind is None and isinstance(node, dict) and all(_kind_default(m) is None for m in models):
        # A union without `kind` (task.prompts: a dataset or reasoning-gym): the model that
        # knows the most of the node's keys.
        return max(models, key=lambda m: len(node.keys() & m.model_fields.keys()), default=None)
    return next((m for m in models if _kind_default(m) == kind), None)


def _kind_default(model: type[BaseModel]) -> Any:
    field = model.model_fields.get("kind")
    return field.default if field else None


def _models_in(annotation: Any) -> typing.Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    origin = typing.get_origin(annotation)
    if origin is None and not isinstance(annotation, types.UnionType):
        return
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _dotted(path: KeyPath) -> str:
    return ".".join(map(str, path)) or "<recipe>"
