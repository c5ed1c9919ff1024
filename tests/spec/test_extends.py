"""`extends:`: deep merge under the extending file, lists replaced, errors located per file."""

from __future__ import annotations

from mtprun.preflight import check_recipe, load_recipe

BASE_FILE = """\
name: base
model:
  tiny: {hidden: 128, heads: 2, kv_heads: 1}
data:
  source: arithmetic
  packing_length: 256
trainer:
  lr: 0.01
  steps: 50
losses:
  - kind: ce
  - kind: z_loss
"""


def test_deep_merge_with_lists_replaced(write_recipe) -> None:
    write_recipe(BASE_FILE, "base.yaml")
    child = write_recipe(
        "extends: base.yaml\nname: child\ntrainer: {steps: 5}\nlosses: [{kind: ce, weight: 2}]\n"
    )
    recipe = load_recipe(child)
    assert recipe.name == "child"
    assert (recipe.trainer.lr, recipe.trainer.steps) == (0.01, 5)
    assert recipe.data is not None and recipe.data.packing_length == 256
    assert [(t.kind, t.weight) for t in recipe.losses] == [("ce", 2.0)]


def test_later_bases_win_and_the_file_itself_wins_over_all(write_recipe) -> None:
    write_recipe(BASE_FILE, "a.yaml")
    write_recipe("trainer: {lr: 0.5, steps: 7}\n", "b.yaml")
    child = write_recipe("extends: [a.yaml, b.yaml]\ntrainer: {steps: 9}\n")
    recipe = load_recipe(child)
    assert (recipe.name, recipe.trainer.lr, recipe.trainer.steps) == ("base", 0.5, 9)


def test_errors_are_located_in_the_file_that_wrote_them(write_recipe, located) -> None:
    base = write_recipe(BASE_FILE.replace("steps: 50", "steps: fifty"), "base.yaml")
    child = write_recipe("extends: base.yaml\ntrainer: {lr: -1}\n")
    assert located(child) == [
        f"{child}:2:15: trainer.lr: input should be greater than 0 (got -1)",
        f"{base}:9:10: trainer.steps: input should be a valid integer, unable to parse string "
        "as an integer (got 'fifty')",
    ]


def test_a_replaced_value_leaves_no_error_behind(write_recipe, located) -> None:
    write_recipe(BASE_FILE.replace("kind: z_loss", "kind: focal"), "base.yaml")
    child = write_recipe("extends: base.yaml\nlosses: [{kind: ce}]\n")
    assert located(child) == []


def test_relative_files_resolve_against_the_file_that_names_them(write_recipe) -> None:
    write_recipe(BASE_FILE.replace("source: arithmetic", "source: sft.jsonl"), "lib/base.yaml")
    write_recipe("", "lib/sft.jsonl")
    child = write_recipe("extends: lib/base.yaml\n")
    recipe = load_recipe(child)
    assert recipe.data is not None
    assert recipe.data.source == str(child.parent / "lib" / "sft.jsonl")


def test_cycle_is_reported_with_the_chain(write_recipe, located) -> None:
    a = write_recipe(BASE_FILE + "extends: b.yaml\n", "a.yaml")
    b = write_recipe("extends: a.yaml\n", "b.yaml")
    assert located(a) == [f"{b}:1:10: extends cycle: {a} -> {b} -> {a}"]


def test_missing_base_file(write_recipe, located) -> None:
    child = write_recipe("name: c\nextends: nope.yaml\n")
    assert located(child) == [
        f"{child}:2:10: extended file not found: {child.parent / 'nope.yaml'}"
    ]


def test_extends_must_name_files(write_recipe, located) -> None:
    child = write_recipe("extends: [base.yaml, 3]\n")
    write_recipe(BASE_FILE, "base.yaml")
    assert located(child) == [
        f"{child}:1:22: extends takes a file name or a list of file names, relative to this file"
    ]


def test_extended_recipe_passes_rules_only_after_merging(write_recipe) -> None:
    # The base alone has no data/task; the merged recipe does.
    write_recipe("name: b\nmodel: {tiny: {heads: 2, kv_heads: 1}}\n", "base.yaml")
    child = write_recipe("extends: base.yaml\ndata: {source: arithmetic}\n")
    assert check_recipe(child).errors == ()
