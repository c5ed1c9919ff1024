"""The recipe language: typed sections, YAML loading with located errors, cross-field rules.

`mtprun.preflight.check_recipe` / `load_recipe` check a recipe file with every rule, those
that need the data, the model's config.json or the compiler included.

The names below are imported on first use (PEP 562): a process that needs one light module
of the package (a reward worker's `mtprun.spec.errors`) does not load every section, pydantic
and the loss units (~0.8 CPU-seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtprun.spec.errors import Diagnostic, Position, RecipeError, RecipeWarning
    from mtprun.spec.loader import RecipeCheck
    from mtprun.spec.recipe import Recipe

_MODULE_OF = {
    "Diagnostic": "mtprun.spec.errors",
    "Position": "mtprun.spec.errors",
    "RecipeError": "mtprun.spec.errors",
    "RecipeWarning": "mtprun.spec.errors",
    "RecipeCheck": "mtprun.spec.loader",
    "Recipe": "mtprun.spec.recipe",
}

__all__ = ["Diagnostic", "Position", "Recipe", "RecipeCheck", "RecipeError", "RecipeWarning"]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value
