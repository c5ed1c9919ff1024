"""A user's own task end to end through the `mtprun` console script (real Ray, vLLM,
Megatron-core, MLflow): prompts from the example parquet file with a column mapping and a
held-out split, an SFT warm start read from the same file, a reward function from a user file
(the example's, wrapped to raise on some prompts), `eval:` every 2 steps and at the end with
rollouts generated a step ahead (`max_staleness: 1`: each evaluation runs between the weight
sync and the next rollouts), and `mtprun eval` on the saved checkpoint afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from .cli_run import E2E_TINY, ENV, MTPRUN, RunRecord, finish, start, write_recipe

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "recipes" / "examples"
STEPS, HELDOUT, EVAL_SAMPLES = 3, 6, 2
USER_REWARD = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
from rewards import score as example_score

def score(prompt, completion, answer):
    if prompt["op"] == "-":
        raise ValueError("this verifier cannot do differences")
    return example_score(prompt, completion, answer)
"""
COLUMNS = {"prompt": "question", "answer": "solution"}


def _recipe(run_dir: Path) -> dict:
    prompts = str(EXAMPLES / "prompts.parquet")
    return {
        "name": "e2e-user-task",
        "run_dir": str(run_dir),
        "model": {"tiny": E2E_TINY},
        "warmstart": {
            "data": {"source": {"path": prompts, "columns": COLUMNS}, "packing_length": 256},
            "steps": 1,
            "lr": 1e-3,
        },
        "task": {
            "prompts": {"path": prompts, "columns": COLUMNS, "heldout": HELDOUT},
            "reward": "user_reward.py:score",
            "reward_on_error": -0.5,
            "samples_per_prompt": 4,
            "prompts_per_step": 4,
        },
        "eval": {"every": 2, "samples": EVAL_SAMPLES, "pass_k": [1, 2], "temperature": 0.7},
        "losses": [{"kind": "grpo"}],
        "rollout": {"max_tokens": 6, "max_staleness": 1},
        "trainer": {"lr": 1e-4, "steps": STEPS, "micro_batch_tokens": 512},
        "resources": {"num_cpus": 2},
    }


@pytest.fixture(scope="module")
def user_run():
    root = Path(tempfile.mkdtemp(prefix="usr", dir="/tmp"))  # short: Ray's sockets live here
    run_dir = root / "run"
    (root / "user_reward.py").write_text(USER_REWARD)
    recipe = write_recipe(root, _recipe(run_dir))
    code, out = finish(start(recipe, cwd=root))
    assert code == 0, out[-3000:]
    evaluated = subprocess.run(
        [*MTPRUN, "eval", str(run_dir), "--step", str(1 + STEPS)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    yield {"run_dir": run_dir, "record": RunRecord(run_dir), "eval": evaluated}
    shutil.rmtree(root, ignore_errors=True)


def test_the_user_reward_components_and_errors_are_logged(user_run):
    record, total = user_run["record"], 1 + STEPS
    grpo_steps = list(range(2, total + 1))
    for key in ("reward/correct", "reward/format", "reward/errors", "reward/mean"):
        assert record.steps(key) == grpo_steps, key
    assert record.steps("eval/reward/correct")[0] == 2
    # The wrapped reward raises on differences: those episodes count as errors, scored -0.5.
    errors = record.values("reward/errors")
    assert sum(errors) > 0 and all(e % 4 == 0 for e in errors)  # whole groups of 4 samples
    assert min(record.values("reward/mean")) >= -0.5
    log = (user_run["run_dir"] / "log.txt").read_text()
    assert "ValueError: this verifier cannot do differences" in log
    assert "scored -0.5 (task.reward_on_error)" in log


def test_eval_runs_every_2_steps_and_at_the_end_on_the_heldout_rows(user_run):
    record, total = user_run["record"], 1 + STEPS
    # Global steps: 1 is the warm start; the GRPO stage's steps 2..4 evaluate at 2 and 4
    # (`mtprun eval` of step 4 added a second point there).
    for key in ("eval/pass_at_1", "eval/pass_at_2", "eval/reward/mean", "eval/reward/errors"):
        assert record.steps(key) == [2, total, total], key
    assert set(record.values("eval/prompts")) == {HELDOUT}
    assert max(record.values("rollout/staleness_max")) == 1  # asynchronous beside evaluation
    history = {
        key: {
            (m.step, m.timestamp): m.value
            for m in record.client.get_metric_history(record.run_id, key)
        }
        for key in ("eval/pass_at_1", "eval/pass_at_2")
    }
    assert history["eval/pass_at_1"].keys() == history["eval/pass_at_2"].keys()
    for point, p1 in history["eval/pass_at_1"].items():
        assert 0.0 <= p1 <= history["eval/pass_at_2"][point] <= 1.0


def test_mtprun_eval_scores_a_saved_checkpoint(user_run):
    done, run_dir = user_run["eval"], user_run["run_dir"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"evaluation of step {1 + STEPS}:" in done.stdout
    saved = json.loads((run_dir / "eval" / f"step_{1 + STEPS}.json").read_text())
    assert saved["eval/prompts"] == HELDOUT and 0.0 <= saved["eval/pass_at_2"] <= 1.0
    history = user_run["record"].client.get_metric_history(
        user_run["record"].run_id, "eval/pass_at_2"
    )
    assert sum(m.step == 1 + STEPS for m in history) == 2  # the run's and mtprun eval's
