"""The recipe language: typed sections, YAML loading with located errors, cross-field rules.

`mtprun.preflight.check_recipe` / `load_recipe` check a recipe file with every rule, those
that need the data, the model's config.json or the compiler included.
"""

from mtprun.spec.errors import Diagnostic, Position, RecipeError, RecipeWarning
from mtprun.spec.loader import RecipeCheck
from mtprun.spec.recipe import Recipe

__all__ = ["Diagnostic", "Position", "Recipe", "RecipeCheck", "RecipeError", "RecipeWarning"]
