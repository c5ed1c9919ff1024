"""Recipe files -> validated `Recipe`: extends, overrides, schema, cross-field rules.

The pieces, each given what it needs: `read_document` (extends, overrides, paths made relative
to the file that wrote them) and `check_document` (schema and a set of rules, every problem
located). `mtprun.preflight.check_recipe` puts them together with every rule.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from mtprun.losses import RecipeTerm
from mtprun.spec.data import VERIFIERS_ENVIRONMENT
from mtprun.spec.diagnose import validation_diagnostics
from mtprun.spec.document import Document, KeyPath
from mtprun.spec.errors import Diagnostic
from mtprun.spec.extends import load_with_extends
from mtprun.spec.overrides import apply_overrides
from mtprun.spec.recipe import SKIP_RULES, Recipe
from mtprun.spec.rules import RuleSet

_TERM = TypeAdapter(RecipeTerm)


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


def read_document(
    path: str | os.PathLike[str], overrides: Sequence[str], builtin_tasks: Collection[str]
) -> Document:
    """The recipe file `path` with the files it extends and the `KEY=VALUE` overrides merged
    in, its file paths made absolute (a value naming one of `builtin_tasks` is not a path).

    Raises RecipeError for a file that cannot be read or merged.
    """
    doc = apply_overrides(load_with_extends(FilePath(path)), overrides)
    _resolve_relative_paths(doc, builtin_tasks)
    return doc


def check_document(doc: Document, rules: RuleSet) -> RecipeCheck:
    """Validate loaded recipe data against the schema and `rules`."""
    diagnostics: list[Diagnostic] = []
    try:
        recipe: Recipe | None = Recipe.model_validate(doc.data, context={SKIP_RULES: True})
        view, invalid = recipe, frozenset[str]()
    except ValidationError as exc:
        recipe = None
        diagnostics += validation_diagnostics(exc, doc)
        view, invalid = _partial_recipe(doc.data)
    if view is not None:
        for issue in rules.check(view, invalid):
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


def _valid_term(item: Any) -> RecipeTerm | None:
    try:
        return _TERM.validate_python(item)
    except ValidationError:
        return None


# Values in a recipe that name files, resolved against the file that sets them. How to read
# each: "file" a path; "source" a path unless it names a built-in synthetic task; "dataset" the
# same, or a mapping whose `path` is one.
_FILE_FIELDS: tuple[tuple[KeyPath, str], ...] = (
    (("model", "path"), "file"),
    (("model", "lora", "path"), "file"),
    (("data", "source"), "dataset"),
    (("task", "name"), "source"),
    (("task", "prompts"), "dataset"),
    (("task", "search", "corpus"), "file"),
    (("warmstart", "data", "source"), "dataset"),
    (("eval", "prompts"), "dataset"),
)

# Python references (`path/to/file.py:Name` or `package.module:Name`, see
# mtprun.data.references): a file part is resolved against the file that sets it, a module name
# (and a built-in reward's name) is left as it is.
_REFERENCE_FIELDS: tuple[KeyPath, ...] = (("task", "environment"), ("task", "reward"))


def _resolve_relative_paths(doc: Document, builtin_tasks: Collection[str]) -> None:
    _resolve_file_paths(doc, builtin_tasks)
    _resolve_verifiers_file(doc)
    references = list(_REFERENCE_FIELDS)
    rewards = doc.get(("task", "rewards"))
    if isinstance(rewards, list):
        references += [("task", "rewards", i, "reward") for i in range(len(rewards))]
    # A judge's `parse` may name a function (a regular expression has no `.py:`).
    references += [(*where, "parse") for where in _reward_mappings(doc)]
    for path in references:
        value = doc.get(path)
        if not isinstance(value, str) or ".py:" not in value:
            continue
        file, _, name = value.rpartition(":")
        _set_relative(doc, path, file, suffix=f":{name}")


def _resolve_verifiers_file(doc: Document) -> None:
    """`task.environment: verifiers:path/to/file.py`: the file relative to the recipe."""
    value = doc.get(("task", "environment"))
    if isinstance(value, str) and value.startswith(VERIFIERS_ENVIRONMENT) and value.endswith(".py"):
        file = value.removeprefix(VERIFIERS_ENVIRONMENT)
        _set_relative(doc, ("task", "environment"), file, prefix=VERIFIERS_ENVIRONMENT)


def _resolve_file_paths(doc: Document, builtin_tasks: Collection[str]) -> None:
    fields = list(_FILE_FIELDS)
    losses = doc.get(("losses",))
    if isinstance(losses, list):
        fields += [(("losses", i, "teacher"), "file") for i in range(len(losses))]
    # A judge's prompt template, in task.reward or an entry of task.rewards, and a served
    # reward model's folder (an endpoint's `model` is a name: it has no `kind`).
    for where in _reward_mappings(doc):
        fields.append(((*where, "prompt"), "file"))
        if "kind" in doc.get(where):
            fields.append(((*where, "model"), "file"))
    for path, kind in fields:
        value = doc.get(path)
        if isinstance(value, dict) and kind == "dataset":
            path, value = (*path, "path"), value.get("path")
        if isinstance(value, str) and (kind == "file" or value not in builtin_tasks):
            _set_relative(doc, path, value)


def _reward_mappings(doc: Document) -> list[KeyPath]:
    """Where task.reward and task.rewards hold a mapping (a judge or a served model)."""
    rewards = doc.get(("task", "rewards"))
    places: list[KeyPath] = [("task", "reward")]
    if isinstance(rewards, list):
        places += [("task", "rewards", i) for i in range(len(rewards))]
    return [where for where in places if isinstance(doc.get(where), dict)]


def _set_relative(
    doc: Document, path: KeyPath, value: str, suffix: str = "", prefix: str = ""
) -> None:
    """Replace the value at `path` by (`prefix` +) `value` (+ `suffix`) made absolute against
    the file that wrote it; command-line paths are relative to the working directory already."""
    file = doc.position(path).file
    if os.path.isabs(value) or file.startswith("<override"):
        return
    parent = doc.get(path[:-1])
    absolute = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(file)), value))
    parent[path[-1]] = prefix + absolute + suffix


def _file_order(doc: Document) -> Callable[[str], tuple[int, str]]:
    """Sort key of files: the recipe itself, then the files it extends, then overrides."""
    main = doc.position(()).file

    def rank(file: str) -> tuple[int, str]:
        return (0 if file == main else 2 if file.startswith("<override") else 1, file)

    return rank
