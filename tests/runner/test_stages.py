"""How a recipe becomes stages, and the SFT row order that makes resumes exact."""

import pytest

from mtprun.compiler import compile_recipe
from mtprun.data.tokenizer import build_tokenizer
from mtprun.runner.run.sft_source import SftSource
from mtprun.runner.run.stages import plan_stages
from mtprun.spec import Recipe

TINY = {"tiny": {"architecture": "qwen2", "hidden": 64, "heads": 2, "kv_heads": 1}}
TASK = {"name": "arithmetic", "reward": "arithmetic"}
DATA = {"source": "arithmetic", "packing_length": 128, "num_samples": 64}


def _recipe(**sections) -> Recipe:
    return Recipe.model_validate({"name": "stages", "model": TINY, **sections})


def test_rl_recipe_with_warmstart_is_sft_then_grpo_on_one_step_counter():
    recipe = _recipe(
        task=TASK,
        warmstart={"data": DATA, "steps": 7, "lr": 3e-3},
        losses=[{"kind": "grpo", "kl_coef": 0.1}],
        trainer={"lr": 1e-5, "steps": 5},
    )
    warm, grpo = plan_stages(recipe)
    assert (warm.name, warm.kind, warm.offset, warm.last_step) == ("warmstart", "sft", 0, 7)
    assert (grpo.name, grpo.kind, grpo.offset, grpo.last_step) == ("grpo", "grpo", 7, 12)
    assert warm.recipe.trainer.lr == 3e-3 and warm.recipe.trainer.steps == 7
    assert [t.kind for t in warm.plan.terms] == ["ce"]
    assert warm.recipe.data == recipe.warmstart.data and warm.recipe.task is None
    assert grpo.recipe is recipe and grpo.plan == compile_recipe(recipe)
    assert [warm.contains(s) for s in (0, 1, 7, 8)] == [False, True, True, False]
    assert grpo.contains(8) and grpo.contains(12) and not grpo.contains(13)
    assert grpo.needs_reference and not warm.needs_reference


def test_sft_recipe_is_one_stage():
    (stage,) = plan_stages(_recipe(data=DATA, trainer={"steps": 4}))
    assert (stage.kind, stage.offset, stage.steps) == ("sft", 0, 4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # SftSource only reads the tokenizer of the model folder.
    folder = tmp_path_factory.mktemp("model")
    build_tokenizer("char").save_pretrained(folder)
    return folder


def test_sft_rows_are_a_pure_function_of_seed_and_step(model_dir):
    recipe = _recipe(data=DATA, seed=3)
    source, again = SftSource(recipe, model_dir), SftSource(recipe, model_dir)
    rows = len(source.rows)
    assert rows > 2
    epoch = [_tokens(source.batches(s)[0]) for s in range(1, rows + 1)]
    # One epoch visits every packed row once, in a seeded order that a fresh source repeats.
    assert sorted(epoch) == sorted(_tokens(b) for b in source.rows)
    assert len(set(epoch)) == rows  # rows are distinct, so the order is the visit order
    for step in (1, rows, rows + 1, 3 * rows + 2):
        assert again.batches(step)[0].input_ids.equal(source.batches(step)[0].input_ids)
    second_epoch = [_tokens(source.batches(s)[0]) for s in range(rows + 1, 2 * rows + 1)]
    assert second_epoch != epoch


def _tokens(batch) -> tuple[int, ...]:
    return tuple(batch.input_ids.tolist())
