"""Command-line overrides: typed through the schema, errors located at `<override N>`."""

from __future__ import annotations

import pytest

from mtprun.preflight import load_recipe

RECIPE = """\
name: t
model:
  tiny: {hidden: 128, heads: 2, kv_heads: 1, architecture: mimo, mtp_layers: 1}
data: {source: arithmetic}
losses:
  - kind: ce
"""


def test_values_are_typed_through_the_schema(write_recipe) -> None:
    path = write_recipe(RECIPE)
    recipe = load_recipe(
        path,
        [
            "trainer.lr=3e-5",
            "trainer.steps=12",
            "losses.0.weight=0.5",
            "mask={assistant: true, tool: false}",
            "rollout.speculative.method=mtp",
            "losses.1={kind: mtp, depth: 1}",
            "losses.2.kind=entropy",
            "trainer.grad_clip=null",
        ],
    )
    assert recipe.trainer.lr == pytest.approx(3e-5)
    assert recipe.trainer.steps == 12
    assert recipe.trainer.grad_clip is None
    assert [(t.kind, t.weight) for t in recipe.losses] == [
        ("ce", 0.5),
        ("mtp", 0.3),
        ("entropy", 0.0),
    ]
    assert recipe.mask == {"assistant": True, "tool": False}
    assert recipe.rollout.speculative is not None
    assert recipe.rollout.speculative.num_speculative_tokens == 1


def test_later_override_wins(write_recipe) -> None:
    recipe = load_recipe(write_recipe(RECIPE), ["seed=1", "seed=2"])
    assert recipe.seed == 2


def test_every_bad_override_is_reported_at_once(write_recipe, located) -> None:
    path = write_recipe(RECIPE)
    overrides = [
        "trainer.lr",
        "losses.5.weight=1",
        "name.first=x",
        "extends=other.yaml",
        "trainer.lr=[1",
        "a..b=1",
    ]
    assert located(path, overrides) == [
        "<override 1>:1:1: expected KEY=VALUE (e.g. trainer.lr=3e-5), got 'trainer.lr'",
        "<override 2>:1:1: 'losses' is a list of 1; index '5' is not in 0..1",
        "<override 3>:1:1: cannot set a key inside 'name': it is 't', not a mapping",
        "<override 4>:1:1: extends cannot be overridden; edit the recipe",
        "<override 5>:1:14: YAML syntax error: expected ',' or ']', but got '<stream end>'",
        "<override 6>:1:1: empty segment in key 'a..b'",
    ]


def test_schema_errors_point_at_the_override(write_recipe, located) -> None:
    path = write_recipe(RECIPE)
    assert located(path, ["trainer.lrr=1", "trainer.steps=-3", "losses.0.kind=focal"]) == [
        "<override 1>:1:1: unknown key 'lrr' in 'trainer' (did you mean 'lr'?)",
        "<override 2>:1:15: trainer.steps: input should be greater than or equal to 1 (got -3)",
        "<override 3>:1:15: losses.0: unknown loss kind 'focal'; allowed: ce, z_loss, grpo, "
        "entropy, distill, mtp, router_aux, router_z",
    ]


def test_nested_value_errors_are_located_inside_the_override(write_recipe, located) -> None:
    path = write_recipe(RECIPE)
    assert located(path, ["trainer={lr: 1, steps: x}"]) == [
        "<override 1>:1:24: trainer.steps: input should be a valid integer, unable to parse "
        "string as an integer (got 'x')"
    ]
