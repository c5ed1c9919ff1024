"""`load_recipe`, the library entry point: a Recipe, or RecipeError listing every problem."""

from __future__ import annotations

import pytest

from mtprun.preflight import load_recipe
from mtprun.spec import RecipeError, RecipeWarning

RECIPE = "name: t\nmodel: {tiny: {heads: 2, kv_heads: 1}}\ndata: {source: arithmetic}\n"


def test_invalid_recipe_raises_with_every_error(write_recipe) -> None:
    path = write_recipe(RECIPE + "trainer: {lr: 0, steps: x}\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    lines = str(error.value).splitlines()
    assert [d.position.col for d in error.value.diagnostics] == [15, 25]
    assert lines == [str(d) for d in error.value.diagnostics]
    assert lines[0] == f"{path}:4:15: trainer.lr: input should be greater than 0 (got 0)"


def test_warnings_go_through_the_warnings_module(write_recipe) -> None:
    path = write_recipe(RECIPE + "trainer: {steps: 2, warmup_steps: 5}\n")
    with pytest.warns(RecipeWarning, match=r":4:35: warning: warmup_steps 5 > steps 2"):
        recipe = load_recipe(path)
    assert recipe.trainer.warmup_steps == 5
