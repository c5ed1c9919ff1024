"""The Recipe model used directly (the library path): defaults, immutability, rules."""

from __future__ import annotations

import pydantic
import pytest

from mtprun.spec import Recipe

MINIMAL = {"name": "m", "model": {"tiny": {}}, "data": {"source": "arithmetic"}}


def test_defaults_fill_run_folder_and_tracking_uri() -> None:
    recipe = Recipe.model_validate(MINIMAL)
    assert recipe.run_dir == "runs/m"
    assert recipe.tracking.uri == "sqlite:///runs/m/mlflow.db"
    assert [t.kind for t in recipe.losses] == ["ce"]
    assert recipe.mask == "sampled"
    assert recipe.parallel.world_size == 1
    assert recipe.model.tiny is not None and recipe.model.tiny.head_dim == 32
    assert not recipe.is_rl


def test_explicit_run_dir_moves_the_default_tracking_store() -> None:
    recipe = Recipe.model_validate({**MINIMAL, "run_dir": "/scratch/x"})
    assert recipe.tracking.uri == "sqlite:////scratch/x/mlflow.db"


def test_recipe_is_frozen() -> None:
    recipe = Recipe.model_validate(MINIMAL)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        recipe.trainer.lr = 1.0  # type: ignore[misc]


def test_roles_table_parses_to_a_dict() -> None:
    recipe = Recipe.model_validate({**MINIMAL, "mask": {"assistant": True, "tool": False}})
    assert recipe.mask == {"assistant": True, "tool": False}


def test_cross_field_rules_apply_without_the_loader() -> None:
    message = r"losses\.0\.kind: loss .grpo. trains on rollouts and needs a .task:"
    with pytest.raises(pydantic.ValidationError, match=message):
        Recipe.model_validate({**MINIMAL, "losses": [{"kind": "grpo"}]})


def test_model_needs_exactly_one_of_path_and_tiny() -> None:
    with pytest.raises(pydantic.ValidationError, match="exactly one of `path`"):
        Recipe.model_validate({**MINIMAL, "model": {"path": "/m", "tiny": {}}})
