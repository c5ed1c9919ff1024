"""Recipe -> HeadPlan."""

from __future__ import annotations

from mtprun.compiler.plan import HeadPlan
from mtprun.spec.recipe import Recipe


def compile_recipe(recipe: Recipe) -> HeadPlan:
    """The fused head-loss plan of `recipe`: its loss terms, vocab split over `parallel.tp`."""
    return HeadPlan.compile(recipe.losses, tp_size=recipe.parallel.tp)
