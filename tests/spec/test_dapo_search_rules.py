"""DAPO's over-long settings and the Search-R1 task, refused at the offending value."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = "name: t\nmodel:\n  tiny:\n    hidden: 128\n    heads: 2\n    kv_heads: 1\n"  # 6 lines
LOSSES = "losses: [{kind: grpo}]\n"
SHIPPED = Path(__file__).resolve().parents[2] / "recipes" / "examples" / "search"


def _rl(task: str, rollout: str = "") -> str:
    return TINY + task + LOSSES + rollout


def test_overlong_buffer_must_be_below_max_tokens(write_recipe, located) -> None:
    task = "task: {name: arithmetic, reward: arithmetic, overlong_buffer: {tokens: 64}}\n"
    path = write_recipe(_rl(task, "rollout: {max_tokens: 64}\n"))
    [error] = located(path)
    assert error == (
        f"{path}:7:72: overlong_buffer.tokens 64 must be below rollout.max_tokens 64: the "
        "penalty ramps over the last `tokens` tokens below it"
    )
    assert located(write_recipe(_rl(task, "rollout: {max_tokens: 65}\n"))) == []


def test_overlong_penalty_is_positive(write_recipe, located) -> None:
    task = (
        "task: {name: arithmetic, reward: arithmetic, overlong_buffer: {tokens: 8, penalty: 0}}\n"
    )
    [error] = located(write_recipe(_rl(task)))
    assert ":7:" in error and "greater than 0" in error


def test_mask_truncated_refuses_mask_all(write_recipe, located) -> None:
    task = "task: {name: arithmetic, reward: arithmetic}\n"
    path = write_recipe(_rl(task, "mask: all\nrollout: {mask_truncated: true}\n"))
    [error] = located(path)
    assert error.startswith(f"{path}:10:27: mask_truncated takes truncated rollouts'")
    assert located(write_recipe(_rl(task, "rollout: {mask_truncated: true}\n"))) == []


def _search(extra: str = "", search: str | None = None) -> str:
    search = search or f"{{corpus: {SHIPPED / 'corpus.jsonl'}, top_k: 2, max_turns: 3}}"
    return (
        f"task:\n  name: search\n  prompts: {SHIPPED / 'questions.jsonl'}\n"
        f"  search: {search}\n{extra}"
    )


def test_the_search_task_validates(write_recipe, located) -> None:
    assert located(write_recipe(_rl(_search()))) == []


@pytest.mark.parametrize(
    ("extra", "where", "message"),
    [
        ("  reward: exact_answer\n", "11:11", "the search task's environment scores every"),
        ("  max_turns: 2\n", "11:14", "the search task's turns are task.search.max_turns"),
    ],
)
def test_the_search_task_refuses_what_it_owns(write_recipe, located, extra, where, message):
    path = write_recipe(_rl(_search(extra)))
    [error] = located(path)
    assert error.startswith(f"{path}:{where}: {message}"), error


def test_the_search_task_needs_a_retriever(write_recipe, located) -> None:
    [error] = located(write_recipe(_rl(_search(search="{top_k: 2}"))))
    assert "search needs `corpus:`" in error and "and has neither" in error
    url = "{corpus: c.jsonl, endpoint: 'http://h:8000/retrieve'}"
    [error] = located(write_recipe(_rl(_search(search=url))))
    assert "not both" in error


def test_a_missing_corpus_is_reported_at_it(write_recipe, located) -> None:
    path = write_recipe(_rl(_search(search="{corpus: nowhere.jsonl}")))
    assert located(path) == [f"{path}:10:20: file not found: {path.parent / 'nowhere.jsonl'}"]


def test_search_settings_need_the_search_task(write_recipe, located) -> None:
    corpus = SHIPPED / "corpus.jsonl"
    task = f"task: {{name: arithmetic, reward: arithmetic, search: {{corpus: {corpus}}}}}\n"
    [error] = located(write_recipe(_rl(task)))
    assert "task.search configures the Search-R1 task: set task.name: search" in error
