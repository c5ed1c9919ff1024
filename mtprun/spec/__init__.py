"""The recipe language: typed sections, YAML loading with located errors, cross-field rules."""

from mtprun.spec.errors import Diagnostic, Position, RecipeError, RecipeWarning
from mtprun.spec.loader import RecipeCheck, check_recipe, load_recipe
from mtprun.spec.recipe import Recipe

__all__ = [
    "Diagnostic",
    "Position",
    "Recipe",
    "RecipeCheck",
    "RecipeError",
    "RecipeWarning",
    "check_recipe",
    "load_recipe",
]
