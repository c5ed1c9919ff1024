"""Preflight: a recipe held against what lies outside it, before anything runs.

The layer above the recipe language (`mtprun.spec`), the compiler, the models and the data:
the rules that read files, the model's config.json or Python code a recipe names
(`rules.py`), the trainer's memory estimate (`memory.py`), and `check_recipe` /
`load_recipe`, which check a recipe file with every rule (the CLI's entry).
"""

from mtprun.preflight.check import check_recipe, load_recipe

__all__ = ["check_recipe", "load_recipe"]
