"""The shape of a recipe's policy: from `model.tiny`, or from its HF folder's config.json."""

from __future__ import annotations

from pathlib import Path

from mtprun.data.tokenizer import tokenizer_size
from mtprun.models.shape import ModelShape
from mtprun.spec.model import ModelSection
from mtprun.spec.recipe import Recipe


def policy_shape(model: ModelSection, tiny_vocab: int) -> ModelShape | None:
    """The shape of `model`; a tiny model whose vocab is null (its tokenizer's) gets
    `tiny_vocab`. None when an HF folder's config.json is not readable here (for instance a
    cluster path): what needs the shape is then skipped."""
    tiny = model.tiny
    if tiny is not None:
        return ModelShape.from_tiny(tiny, tiny.vocab if tiny.vocab is not None else tiny_vocab)
    return ModelShape.read(model.path or "")


def recipe_shape(recipe: Recipe) -> ModelShape | str:
    """The shape the trainer will build for `recipe` (a tiny model's null vocab is its
    tokenizer's, padded), or why it is unknown here."""
    tiny = recipe.model.tiny
    tiny_vocab = 0
    if tiny is not None and tiny.vocab is None:
        section = recipe.data or recipe.task
        if section is None:
            return "unknown: the tiny model's vocab is the tokenizer's, and no template is set"
        tiny_vocab = tiny.vocab_size(tokenizer_size(section.template))
    shape = policy_shape(recipe.model, tiny_vocab)
    if shape is None:
        return f"unknown: {Path(recipe.model.path or '') / 'config.json'} not readable here"
    return shape
