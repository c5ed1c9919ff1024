"""Whatever a recipe holds, checking it gives located diagnostics, never an exception."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from mtprun.preflight import check_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

VALUES = (
    st.none()
    | st.booleans()
    | st.integers(-3, 10**6)
    | st.text(max_size=6)
    | st.lists(st.integers(0, 3), max_size=2)
    | st.dictionaries(
        st.sampled_from(["kind", "depth", "x", "tiny"]), st.integers(0, 3), max_size=2
    )
)


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    children: list[tuple] = []
    if isinstance(node, dict):
        for key, value in node.items():
            children += _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            children += _paths(value, (*path, i))
    return [path, *children]


def _set(data: Any, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    recipe=st.sampled_from(sorted(RECIPES.glob("*.yaml"))),
    edits=st.lists(st.tuples(st.integers(0, 10**6), VALUES), min_size=1, max_size=4),
)
def test_mutated_recipes_are_diagnosed_not_crashed(recipe: Path, edits: list) -> None:
    data = YAML(typ="safe").load(recipe)
    for index, value in edits:
        paths = [p for p in _paths(data) if p]
        _set(data, paths[index % len(paths)], value)
    stream = io.StringIO()
    YAML(typ="safe").dump(data, stream)
    text = stream.getvalue()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mutated.yaml"
        path.write_text(text)
        check = check_recipe(path)
    lines = len(text.splitlines())
    for diagnostic in check.diagnostics:
        assert diagnostic.position.file == str(path)
        assert 1 <= diagnostic.position.line <= lines + 1
        assert diagnostic.message
    assert (check.recipe is None) == bool(check.errors)
