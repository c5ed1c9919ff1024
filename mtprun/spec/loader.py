"""Recipe files -> validated `Recipe`: extends, overrides, schema, cross-field rules."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from mtprun.spec.diagnose import validation_diagnostics
from mtprun.spec.document import Document, KeyPath
from mtprun.spec.errors import Diagnostic, RecipeError, RecipeWarning
from mtprun.spec.extends import load_with_extends
from mtprun.spec.losses import LossTerm
from mtprun.spec.overrides import apply_overrides
from mtprun.spec.recipe import SKIP_RULES, Recipe
from mtprun.spec.rules import check_rules

_TERM = TypeAdapter(LossTerm)


@dataclass(frozen=True)
class RecipeCheck:
    """The outcome of checking one recipe: the recipe when valid, and every diagnostic."""

    recipe: Recipe | None
    diagnostics: tuple[Diagnostic, ...]

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")

    @property
    def warnings(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "warning")


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Load, merge, override and validate a recipe file.

    Raises RecipeError listing every error; warnings go through `warnings.warn` as RecipeWarning.
    """
    check = check_recipe(path, overrides)
    if check.recipe is None:
        raise RecipeError(check.errors)
    for warning in check.warnings:
        warnings.warn(str(warning), RecipeWarning, stacklevel=2)
    return check.recipe


def check_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RecipeCheck:
    """Every diagnostic of a recipe file; never raises for a bad recipe."""
    try:
        doc = apply_overrides(load_with_extends(FilePath(path)), overrides)
    except RecipeError as exc:
        return RecipeCheck(None, exc.diagnostics)
    _resolve_relative_paths(doc)
    return check_document(doc)


def check_document(doc: Document) -> RecipeCheck:
    """Validate loaded recipe data against the schema and the cross-field rules."""
    diagnostics: list[Diagnostic] = []
    try:
        recipe: Recipe | None = Recipe.model_validate(doc.data, context={SKIP_RULES: True})
        view, invalid = recipe, frozenset[str]()
    except ValidationError as exc:
        recipe = None
        diagnostics += validation_diagnostics(exc, doc)
        view, invalid = _partial_recipe(doc.data)
    if view is not None:
        for issue in check_rules(view, invalid):
            diagnostics.append(
                Diagnostic(doc.position_of(issue.path), issue.message, issue.severity)
            )
    order = _file_order(doc)
    diagnostics.sort(key=lambda d: (order(d.position.file), d.position.line, d.position.col))
    if any(d.severity == "error" for d in diagnostics):
        recipe = None
    return RecipeCheck(recipe, tuple(diagnostics))


def _partial_recipe(data: Any) -> tuple[Recipe | None, frozenset[str]]:
    """The sections of `data` that validate on their own, and the names of those that do not.

    Lets the cross-field rules run on the valid parts of an invalid recipe, so a typo in one
    section does not hide a broken rule elsewhere.
    """
    if not isinstance(data, dict):
        return None, frozenset()
    valid: dict[str, Any] = {}
    invalid: set[str] = set()
    for name, field in Recipe.model_fields.items():
        if name not in data:
            if field.is_required():
                invalid.add(name)
            continue
        value = data[name]
        try:
            if name == "losses" and isinstance(value, list):
                valid[name] = [_valid_term(item) for item in value]
            else:
                valid[name] = _field_adapter(name).validate_python(value)
        except ValidationError:
            invalid.add(name)
    return Recipe.model_construct(**valid), frozenset(invalid)


@functools.cache
def _field_adapter(name: str) -> TypeAdapter[Any]:
    field = Recipe.model_fields[name]
    annotation = field.annotation
    return TypeAdapter(Annotated[annotation, *field.metadata] if field.metadata else annotation)


def _valid_term(item: Any) -> LossTerm | None:
    try:
        return _TERM.validate_python(item)
    except ValidationError:
        return None


# Paths in a recipe that name files, resolved against the file that sets them. Sources are
# files only when they end in .jsonl; otherwise they name built-in synthetic tasks.
_FILE_FIELDS: tuple[tuple[KeyPath, bool], ...] = (
    (("model", "path"), False),
    (("data", "source"), True),
    (("task", "name"), True),
    (("warmstart", "data", "source"), True),
)


# Python references (`path/to/file.py:Name` or `package.module:Name`): a file part is resolved
# against the file that sets it, a module name is left as it is.
_REFERENCE_FIELDS: tuple[KeyPath, ...] = (("task", "environment"),)


def _resolve_relative_paths(doc: Document) -> None:
    _resolve_file_paths(doc)
    for path in _REFERENCE_FIELDS:
        value = doc.get(path)
        if not isinstance(value, str) or ".py:" not in value:
            continue
        file, _, name = value.rpartition(":")
        resolved = _relative_to_recipe(doc, path, file)
        if resolved is not None:
            doc.get(path[:-1])[path[-1]] = f"{resolved}:{name}"


def _relative_to_recipe(doc: Document, path: KeyPath, value: str) -> str | None:
    """`value` made absolute against the recipe file that set `path`; None when it already is,
    or when it came from the command line (relative to the working directory already)."""
    file = doc.position(path).file
    if os.path.isabs(value) or file.startswith("<override"):
        return None
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(file)), value))


def _resolve_file_paths(doc: Document) -> None:
    paths = list(_FILE_FIELDS)
    losses = doc.get(("losses",))
    if isinstance(losses, list):
        paths += [(("losses", i, "teacher"), False) for i in range(len(losses))]
    for path, jsonl_only in paths:
        value = doc.get(path)
        if not isinstance(value, str) or (jsonl_only and not value.endswith(".jsonl")):
            continue
        resolved = _relative_to_recipe(doc, path, value)
        if resolved is not None:
            doc.get(path[:-1])[path[-1]] = resolved


def _file_order(doc: Document) -> Callable[[str], tuple[int, str]]:
    """Sort key of files: the recipe itself, then the files it extends, then overrides."""
    main = doc.position(()).file

    def rank(file: str) -> tuple[int, str]:
        return (0 if file == main else 2 if file.startswith("<override") else 1, file)

    return rank
