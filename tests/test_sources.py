"""The source units (mtprun/sources/, points in mtprun.spec.sources): a recipe's untagged
values get the `type:` the units infer, a tagged value means the same, each layer dispatches
through the registry, and a guessed tag is a deprecation note."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtprun.preflight import check_recipe
from mtprun.sources.scoring import InThreads, InWorkers, OnActor
from mtprun.spec.data import TaskSection
from mtprun.spec.sources import (
    PROMPT_SOURCES,
    REWARD_SOURCES,
    TASK_SOURCES,
    reward_source,
    task_source,
)

JUDGE = {"url": "http://localhost:8000/v1", "model": "m", "prompt": "judge.txt"}
SERVED = {"model": "/models/rm", "kind": "classifier"}


def test_the_points_list_the_sources() -> None:
    assert REWARD_SOURCES.names() == ("function", "endpoint", "served")
    assert PROMPT_SOURCES.names() == ("dataset", "reasoning_gym")
    assert set(TASK_SOURCES.names()) == {"builtin", "prompts", "verifiers", "search"}


def test_the_builtin_task_unit_names_the_data_layers_tasks() -> None:
    from mtprun.data.tasks import TASKS

    assert set(TASK_SOURCES["builtin"].NAMES) == set(TASKS) - {"search"}


@pytest.mark.parametrize(
    ("section", "tag"),
    [
        ({"name": "arithmetic"}, "builtin"),
        ({"name": "prompts.jsonl"}, "prompts"),
        ({"prompts": "prompts.jsonl"}, "prompts"),
        ({"prompts": {"reasoning_gym": "leg_counting"}}, "prompts"),
        ({"environment": "verifiers:my_taskset"}, "verifiers"),
        ({"name": "search", "prompts": "q.jsonl", "search": {"corpus": "c.jsonl"}}, "search"),
    ],
)
def test_an_untagged_task_gets_its_sources_type(section: dict, tag: str) -> None:
    task = TaskSection(**section)
    assert task.type == tag and task.type_inferred
    tagged = TaskSection(**section, type=tag)
    assert not tagged.type_inferred
    assert tagged.model_dump() == task.model_dump()


@pytest.mark.parametrize(
    ("reward", "tag", "plan"),
    [
        ("exact_answer", "function", InWorkers),
        ("rewards.py:score", "function", InWorkers),
        (JUDGE, "endpoint", InThreads),
        (SERVED, "served", OnActor),
    ],
)
def test_a_reward_is_its_sources_and_scores_by_its_plan(reward, tag, plan) -> None:
    task = TaskSection(name="arithmetic", reward=reward)
    spec = task.reward
    assert tag == reward_source(spec).NAME
    assert isinstance(reward_source(spec).scoring(spec), plan)
    if isinstance(reward, dict):  # a tagged mapping is the same reward
        assert TaskSection(name="arithmetic", reward={**reward, "type": tag}).reward == spec


def test_rewards_entries_are_tagged_or_inferred() -> None:
    entries = [{"reward": "exact_answer"}, {**JUDGE, "weight": 0.5}, {**SERVED, "name": "rm"}]
    untagged = TaskSection(name="arithmetic", rewards=entries).rewards
    tagged = TaskSection(
        name="arithmetic",
        rewards=[{**e, "type": t} for e, t in zip(entries, REWARD_SOURCES.names(), strict=True)],
    ).rewards
    assert untagged == tagged
    assert [t.type for t in untagged] == ["function", "endpoint", "served"]
    assert [t.label for t in untagged] == ["exact_answer", "judge", "rm"]


def test_a_type_the_fields_contradict_is_an_error() -> None:
    with pytest.raises(ValueError, match="url"):
        TaskSection(name="arithmetic", reward={**SERVED, "type": "endpoint"})


def test_the_default_reward_is_the_prompt_sources() -> None:
    gym = TaskSection(prompts={"reasoning_gym": "leg_counting"})
    assert task_source(gym).default_reward(gym) == "reasoning_gym" == gym.effective_reward
    assert TaskSection(prompts="p.jsonl").effective_reward is None


def _recipe(tmp_path: Path, task: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: t\nmodel:\n  tiny:\n    hidden: 128\n    heads: 2\n    kv_heads: 1\n"
        f"task: {task}\nlosses: [{{kind: grpo}}]\n",
        encoding="utf-8",
    )
    return path


def test_a_dataset_folder_named_by_task_name_is_a_deprecation_note(tmp_path: Path) -> None:
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n', encoding="utf-8")
    check = check_recipe(_recipe(tmp_path, "{name: prompts, reward: exact_answer}"), [])
    assert check.errors == ()
    (note,) = check.warnings
    assert "deprecated" in note.message and "prompts:" in note.message
    assert note.position.line == 7
    tagged = check_recipe(_recipe(tmp_path, "{prompts: prompts, reward: exact_answer}"), [])
    assert tagged.diagnostics == ()


def test_a_source_check_is_located_below_its_value(tmp_path: Path) -> None:
    task = "{prompts: {type: dataset, path: missing.jsonl}, reward: exact_answer}"
    check = check_recipe(_recipe(tmp_path, task), [])
    (error,) = check.errors
    assert "file not found" in error.message and "missing.jsonl" in error.message
