"""Checkpoint folders and the MLflow tracker, on a real local MLflow store."""

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.run import checkpoint
from mtprun.runner.run.export import export_checkpoint
from mtprun.runner.tracking.spool import Spool
from mtprun.runner.tracking.tracker import Tracker, flatten


def test_publish_is_atomic_and_latest_follows(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoint.latest(root) is None
    for step in (2, 4):
        partial = checkpoint.begin(root, step)
        (partial / "trainer_rank0.pt").write_bytes(b"x")
        checkpoint.publish(partial, {"step": step})
    checkpoint.begin(root, 6)  # a crash while writing step 6 leaves only a .partial folder
    assert checkpoint.steps(root) == [2, 4]
    assert checkpoint.latest(root) == 4
    assert checkpoint.resolve(root, None) == checkpoint.step_dir(root, 4)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 3 .* steps: 2, 4"):
        checkpoint.resolve(root, 3)


def test_prune_keeps_the_newest_and_the_protected_steps(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40, 50):
        checkpoint.publish(checkpoint.begin(root, step), {"step": step})
    checkpoint.begin(root, 60)  # an unfinished save is not a checkpoint to count or delete
    deleted = checkpoint.prune(root, keep=2, protected={20})
    assert deleted == [10, 30]
    assert checkpoint.steps(root) == [20, 40, 50]
    assert checkpoint.latest(root) == 50
    assert checkpoint.step_dir(root, 60).with_suffix(".partial").is_dir()
    assert checkpoint.prune(root, keep=1, protected={20, 50}) == [40]


def test_export_copies_the_hf_folder(tmp_path):
    template = tmp_path / "model"
    template.mkdir()
    (template / "config.json").write_text("{}")
    (template / "model.safetensors").write_bytes(b"old weights, never copied")
    weights = {"embed.weight": torch.randn(4, 3)}
    weights["lm_head.weight"] = weights["embed.weight"]  # tied: shares memory
    partial = checkpoint.begin(tmp_path / "ckpt", 3)
    save_hf_folder(weights, template, partial / "hf")
    checkpoint.publish(partial, {"step": 3})

    out = export_checkpoint(tmp_path / "ckpt", None, tmp_path / "export")
    assert (out / "config.json").read_text() == "{}"
    loaded = load_file(out / "model.safetensors")
    torch.testing.assert_close(loaded["lm_head.weight"], weights["embed.weight"])
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        export_checkpoint(tmp_path / "missing", None, tmp_path / "x")


def test_flatten_recipe_params():
    tree = {"a": {"b": 1, "c": [2, {"d": None}]}, "e": [], "f": "x"}
    assert flatten(tree) == {"a.b": "1", "a.c.0": "2", "a.c.1.d": "None", "e": "[]", "f": "x"}


def test_tracker_reopens_the_same_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tags = {"mtprun.plan_hash": "abc"}
    tracker = Tracker.start(
        uri, "exp", "demo", tags, tmp_path / "art", spool=Spool(tmp_path / "tracking")
    )
    tracker.log_params({"trainer.lr": "0.001"})
    tracker.log_metrics(1, {"train/loss": 2.0})
    assert tracker.finish("KILLED", "stopped by SIGINT after step 1", timeout=30)
    assert MlflowClient(uri).get_run(tracker.run_id).info.status == "KILLED"

    spool = Spool(tmp_path / "tracking")
    again = Tracker.reopen(uri, tracker.run_id, tracker.experiment_id, spool)
    assert again.last_logged_step() == 1
    again.log_metrics(2, {"train/loss": 1.0})
    assert again.finish("FINISHED", timeout=30)
    assert spool.backlog == 0 and spool.path.stat().st_size == 0  # emptied once uploaded

    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"trainer.lr": "0.001"}
    assert run.data.tags["mtprun.error"] == "stopped by SIGINT after step 1"
    history = MlflowClient(uri).get_metric_history(tracker.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 2.0), (2, 1.0)]
