"""`task.environment`: a class named `package.module:Class` or `path/to/file.py:Class` (relative
to the recipe). `mtprun validate` imports it and reports every problem at the value."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

RECIPE = """\
name: t
model:
  tiny:
    hidden: 128
    heads: 2
    kv_heads: 1
task:
  name: calculator_tool
  reward: calculator_tool
  max_turns: 2
  environment: {environment}
losses: [{{kind: grpo}}]
"""
AT = "11:16"  # where the environment's value is written

ENVIRONMENTS = """
from mtprun.data.environment import EnvStep, Environment


class Calculator(Environment):
    def step(self, messages):
        return EnvStep(done=True)


class Plain:  # no base class
    def reset(self, prompt):
        return prompt.messages

    async def step(self, messages):
        return EnvStep(done=True)


class NoStep:
    def reset(self, prompt):
        return prompt.messages


class StepWithoutMessages(Plain):
    def step(self):
        return EnvStep(done=True)


class NeedsArguments(Plain):
    def __init__(self, url):
        self.url = url


class Abstract(Environment):
    pass


def calculator():
    return Calculator()
"""


@pytest.fixture
def recipe_with(write_recipe):
    """recipe_with(environment) -> a recipe in sub/ naming it; sub/envs/tools.py holds the
    classes above."""

    def write(environment: str) -> Path:
        path = write_recipe(RECIPE.format(environment=environment), "sub/r.yaml")
        (path.parent / "envs").mkdir(exist_ok=True)
        (path.parent / "envs" / "tools.py").write_text(textwrap.dedent(ENVIRONMENTS))
        return path

    return write


@pytest.mark.parametrize(
    "environment",
    [
        "envs/tools.py:Calculator",
        "envs/tools.py:Plain",
        "mtprun.data.tasks.calculator:CalculatorEnvironment",
    ],
)
def test_a_class_with_the_interface_validates(recipe_with, located, environment: str) -> None:
    assert located(recipe_with(environment)) == []


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ("envs/tools.py:Calculater", "has no attribute 'Calculater' (did you mean 'Calculator'?)"),
        ("envs/tools.py:NoStep", "class NoStep has no method step(messages) (an environment"),
        ("envs/tools.py:Abstract", "class Abstract does not implement step(messages)"),
        (
            "envs/tools.py:StepWithoutMessages",
            "StepWithoutMessages.step(self) does not take one argument (messages) after self",
        ),
        (
            "envs/tools.py:NeedsArguments",
            "class NeedsArguments(url) cannot be called without arguments",
        ),
        ("envs/tools.py:calculator", "calculator is not a class"),
        ("no_such_package.envs:Calculator", "no module named 'no_such_package.envs'"),
        ("tools", "'tools' is not a Python reference: write `package.module:Name`"),
    ],
)
def test_a_broken_reference_is_reported_at_the_value(
    recipe_with, located, environment: str, message: str
) -> None:
    path = recipe_with(environment)
    [diagnostic] = located(path)
    assert diagnostic.startswith(f"{path}:{AT}: task.environment: "), diagnostic
    assert message in diagnostic


def test_a_missing_file_is_resolved_against_the_recipe(recipe_with, located) -> None:
    path = recipe_with("envs/gone.py:Calculator")
    missing = path.parent / "envs" / "gone.py"
    assert located(path) == [f"{path}:{AT}: task.environment: file not found: {missing}"]


def test_a_module_that_fails_to_import_shows_its_error(recipe_with, located) -> None:
    path = recipe_with("envs/broken.py:Calculator")
    (path.parent / "envs" / "broken.py").write_text("raise RuntimeError('no API key')\n")
    [diagnostic] = located(path)
    assert diagnostic.startswith(f"{path}:{AT}: task.environment: ")
    assert diagnostic.endswith("broken.py failed to import: RuntimeError: no API key")


def test_a_command_line_reference_is_relative_to_the_working_directory(
    recipe_with, located, monkeypatch
) -> None:
    path = recipe_with("envs/tools.py:Plain")
    monkeypatch.chdir(path.parent.parent)
    assert located(path, ["task.environment=sub/envs/tools.py:Calculator"]) == []
    [diagnostic] = located(path, ["task.environment=envs/tools.py:Calculator"])
    assert diagnostic.startswith("<override 1>:1:18: task.environment: file not found")
