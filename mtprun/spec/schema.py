"""JSON Schema of a recipe file, for editors (yaml-language-server) and `mtprun schema`."""

from __future__ import annotations

from typing import Any

from mtprun.spec.recipe import Recipe

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def recipe_json_schema() -> dict[str, Any]:
    """The JSON Schema of a recipe file: the Recipe model plus the loader's `extends` key."""
    schema = Recipe.model_json_schema(mode="validation")
    schema["properties"] = {
        "extends": {
            "description": "Recipe file(s) this one extends, relative to it: deep-merged, "
            "this file's values win, lists are replaced.",
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
        },
        **schema["properties"],
    }
    return {"$schema": SCHEMA_DIALECT, **schema}
