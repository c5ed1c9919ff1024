"""The Search-R1 task end to end on a tiny policy and the shipped corpus: two GRPO steps whose
episodes run in the search environment, scored by exact match (reward/exact_match) and shaped by
DAPO's over-long buffer (reward/overlong), with the BM25 index built in the run folder. The
untrained policy writes no tags, so it searches by chance only: the environment's answers and
retrieval are tested in process (tests/data/test_search_task.py); this run holds the wiring."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from .cli_run import E2E_TINY, RunRecord, finish, start, write_recipe

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[2] / "recipes" / "examples" / "search"
RL_STEPS = 2


@pytest.fixture(scope="module")
def search_run():
    root = Path(tempfile.mkdtemp(prefix="srch", dir="/tmp"))
    recipe = {
        "name": "search-e2e",
        "seed": 0,
        "model": {"tiny": {**E2E_TINY, "max_seq_len": 2048}},
        "task": {
            "name": "search",
            "prompts": str(SHIPPED / "questions.jsonl"),
            "search": {"corpus": str(SHIPPED / "corpus.jsonl"), "top_k": 2, "max_turns": 2},
            "template": "chatml",
            "samples_per_prompt": 2,
            "prompts_per_step": 2,
            "overlong_buffer": {"tokens": 8, "penalty": 0.5},
        },
        "losses": [{"kind": "grpo", "clip_low": 0.2, "clip_high": 0.28}],
        "rollout": {"max_tokens": 24},
        "trainer": {"lr": 1.0e-4, "steps": RL_STEPS, "micro_batch_tokens": 4096},
        "resources": {"num_cpus": 2},
    }
    try:
        run_dir = root / "run"
        path = write_recipe(root, recipe)
        code, out = finish(start(path, f"run_dir={run_dir}", cwd=root))
        assert code == 0, out[-3000:]
        yield RunRecord(run_dir), run_dir
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_episodes_are_scored_by_the_search_environment(search_run) -> None:
    record, run_dir = search_run
    # The environment rewards every episode (no task.reward): no reward error, exact match 0
    # for a policy that never wrote <answer>.
    assert record.values("reward/errors") == [0.0] * RL_STEPS
    assert record.values("reward/exact_match") == [0.0] * RL_STEPS
    assert len(record.values("search/calls")) == RL_STEPS
    assert record.values("search/errors") == [0.0] * RL_STEPS
    [index] = (run_dir / "datasets").glob("bm25-*")  # built once, in the run folder
    assert (index / "params.index.json").is_file()


def test_the_rewards_are_shaped_and_the_steps_train(search_run) -> None:
    record, _ = search_run
    overlong = record.values("reward/overlong")
    assert len(overlong) == RL_STEPS and all(-0.5 <= v <= 0 for v in overlong)
    assert record.values("reward/mean") == pytest.approx(overlong)  # exact match 0 + shaping
    assert all(0 <= f <= 1 for f in record.values("rollout/truncated_frac"))
    trained = record.values("train/trained_token_frac")
    assert len(trained) == RL_STEPS and all(0 < f < 1 for f in trained)
