"""Recipe files -> validated `Recipe`, checked against the schema and every rule."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from mtprun.data.tasks import TASKS
from mtprun.preflight import colocation, partial_rollouts  # noqa: F401  (register rules)
from mtprun.preflight.rules import PREFLIGHT_RULES
from mtprun.spec.errors import RecipeError, RecipeWarning
from mtprun.spec.loader import RecipeCheck, check_document, read_document
from mtprun.spec.recipe import Recipe


def check_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RecipeCheck:
    """Every diagnostic of a recipe file; never raises for a bad recipe."""
    try:
        doc = read_document(path, overrides, builtin_tasks=TASKS)
    except RecipeError as exc:
        return RecipeCheck(None, exc.diagnostics)
    return check_document(doc, PREFLIGHT_RULES)


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
