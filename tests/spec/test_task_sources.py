"""`task.reward` references, `task.prompts` / `data.source` datasets and `eval:` as
`mtprun validate` checks them: importing the reward, checking its signature, every problem at
the value that caused it."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

TINY = "name: t\nmodel:\n  tiny:\n    hidden: 128\n    heads: 2\n    kv_heads: 1\n"  # 6 lines
TAIL = "losses: [{kind: grpo}]\n"

REWARDS_PY = """\
import math

def score(completion, answer):
    return float(completion == answer)

def with_components(prompt, completion, **extra):
    return {"total": 1.0, "length": len(completion)}

def wrong(episode, completion):
    return 0.0

def positional(completion, /):
    return 0.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    (tmp_path / "rewards").mkdir()
    path = tmp_path / "rewards" / "mine.py"
    path.write_text(REWARDS_PY)
    (tmp_path / "rewards" / "broken.py").write_text("import math\n\nraise RuntimeError('boom')\n")
    return path


def _rl(reward: str, prompts: str = "name: arithmetic", extra: str = "") -> str:
    return TINY + f"task: {{{prompts}, reward: '{reward}'}}\n" + TAIL + extra


@pytest.mark.parametrize("reward", ["rewards/mine.py:score", "rewards/mine.py:with_components"])
def test_a_reward_file_relative_to_the_recipe_validates(write_recipe, located, reward_file, reward):
    assert located(write_recipe(_rl(reward))) == []


def test_a_reward_module_on_the_python_path_validates(
    write_recipe, located, monkeypatch, reward_file
):
    monkeypatch.syspath_prepend(str(reward_file.parent))
    assert located(write_recipe(_rl("mine:score"))) == []


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (
            "no_such_pkg.rewards:score",
            "no module named 'no_such_pkg.rewards': write `package.module:Name` (importable) or "
            "`path/to/file.py:Name` (relative to the recipe), with the module on PYTHONPATH",
        ),
        ("rewards/missing.py:score", "file not found: {dir}/rewards/missing.py"),
        (
            "rewards/mine.py:scroe",
            "{dir}/rewards/mine.py has no attribute 'scroe' (did you mean 'score'?)",
        ),
        (
            "rewards/mine.py:wrong",
            "reward wrong(episode, completion) takes 'episode', which mtprun does not pass; a "
            "reward takes any of prompt, completion, messages, answer, reasoning, "
            "raw_completion by name (or **kwargs)",
        ),
        (
            "rewards/mine.py:positional",
            "reward positional(completion, /): parameter 'completion' is positional-only; mtprun "
            "passes arguments by name (prompt, completion, messages, answer, reasoning, "
            "raw_completion)",
        ),
        ("rewards/mine.py:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
        (
            "rewards/broken.py:score",
            "{dir}/rewards/broken.py failed to import: RuntimeError: boom "
            "({dir}/rewards/broken.py:3)",
        ),
        (
            "rewards/mine.py:",
            "'{dir}/rewards/mine.py:' is not a Python reference: write `package.module:Name`",
        ),
    ],
)
def test_a_bad_reward_is_a_validate_error_at_its_value(
    write_recipe, located, reward_file, reward, message
) -> None:
    path = write_recipe(_rl(reward))
    found = located(path)
    assert len(found) == 1, found
    expected = f"{path}:7:34: " + message.format(dir=path.parent)
    assert found[0].startswith(expected), found[0]


def _parquet(path, rows) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_dataset_prompts_validate_and_report_missing_files(write_recipe, located, tmp_path):
    _parquet(tmp_path / "p.parquet", [{"prompt": "1+1=", "answer": "2"}])
    good = _rl("math", "prompts: p.parquet", "eval: {every: 2}\n")
    path = write_recipe(good)
    assert located(path) == [
        f"{path}:9:1: no evaluation prompts: hold rows out of the task's dataset "
        "(task.prompts.heldout: N or a fraction) or give eval.prompts"
    ]
    path = write_recipe(_rl("math", "prompts: {path: p.parquet, heldout: 0.2}", "eval: {}\n"))
    assert located(path) == []
    path = write_recipe(_rl("math", "prompts: {path: q.parquet}"))
    assert located(path) == [f"{path}:7:24: file not found: {tmp_path}/q.parquet"]
    path = write_recipe(_rl("math", "name: arithmetic, prompts: p.parquet"))
    assert located(path) == [
        f"{path}:7:1: a task needs `name:` (a built-in task) or `prompts:` (a dataset), not both"
    ]
    (tmp_path / "notes.txt").write_text("")
    path = write_recipe(TINY + "data: {source: notes.txt}\n")
    assert located(path) == [
        f"{path}:7:16: {tmp_path}/notes.txt is not a dataset file: use .jsonl, .parquet, "
        ".arrow, .csv"
    ]


def test_eval_rules(write_recipe, located):
    path = write_recipe(TINY + "data: {source: arithmetic}\neval: {samples: 2, pass_k: [1, 4]}\n")
    assert located(path) == [
        f"{path}:8:1: eval: pass_k [4] outside 1..samples (2): pass@k needs k samples per "
        "prompt; raise eval.samples",
    ]
    path = write_recipe(TINY + "data: {source: arithmetic}\neval: {}\n")
    assert located(path) == [
        f"{path}:8:1: `eval:` scores the policy with the task's reward and needs `task:`"
    ]


def test_a_task_without_reward_needs_an_environment(write_recipe, located):
    path = write_recipe(TINY + "task: {name: arithmetic}\n" + TAIL)
    assert located(path) == [
        f"{path}:7:1: a task needs `reward:` (a built-in reward such as exact_answer, or "
        "`file.py:function`) or `rewards:`, unless its prompts come from reasoning-gym or its "
        "task.environment rewards every episode"
    ]
    environment = "mtprun.data.tasks.calculator:CalculatorEnvironment"
    path = write_recipe(TINY + f"task: {{name: arithmetic, environment: '{environment}'}}\n" + TAIL)
    assert located(path) == []
