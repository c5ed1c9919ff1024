"""Tracking never blocks training: the spool and its writer against a real `mlflow server`
that is stopped and started again, and `mtprun sync` for what a run could not upload."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from mtprun.cli import main
from mtprun.runner.net import free_port
from mtprun.runner.run.lock import RunLock
from mtprun.runner.run_dir import RunDir
from mtprun.runner.tracking.server import MlflowServer
from mtprun.runner.tracking.spool import Spool
from mtprun.runner.tracking.tracker import Tracker
from mtprun.runner.tracking.writer import upload

from .cli_run import ENV, MTPRUN

KEYS = ("train/loss", "reward/mean", "time/step_s")


@pytest.fixture
def server(tmp_path):
    folder = tmp_path / "server"
    folder.mkdir()
    srv = MlflowServer(
        f"sqlite:///{folder / 'mlflow.db'}",
        artifacts=folder / "artifacts",
        log=folder / "server.log",
    )
    srv.start()
    yield srv
    srv.stop()


def _log_steps(tracker: Tracker, steps: range) -> float:
    """One metrics record a step, as the driver commits them; returns the slowest call (s)."""
    slowest = 0.0
    for step in steps:
        began = time.monotonic()
        tracker.log_metrics(step, {key: step + i / 10 for i, key in enumerate(KEYS)})
        slowest = max(slowest, time.monotonic() - began)
        time.sleep(0.02)
    return slowest


def _assert_each_point_once(uri: str, run_id: str, last_step: int) -> None:
    client = MlflowClient(uri)
    for i, key in enumerate(KEYS):
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(range(1, last_step + 1)), key
        assert all(m.value == m.step + i / 10 for m in history)


def _wait(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_stopped_and_restarted_server_gets_every_point_once(server, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mtprun")
    spool = Spool(tmp_path / "run" / "tracking")
    tracker = Tracker.start(server.uri, "exp", "outage", {"mtprun.plan_hash": "h"}, spool=spool)
    tracker.log_params({"trainer.lr": "0.001"})
    (tmp_path / "recipe.yaml").write_text("name: outage\n")
    tracker.log_artifact(tmp_path / "recipe.yaml")
    _log_steps(tracker, range(1, 11))
    _wait(lambda: tracker.backlog == 0)

    server.stop()
    slowest = _log_steps(tracker, range(11, 41))  # the run keeps stepping through the outage
    tracker.log_text("episode text", "samples/step_000040.txt")
    _wait(lambda: tracker.outage is not None)
    assert slowest < 0.5, f"a tracking call blocked training for {slowest:.2f} s"
    assert tracker.backlog >= 30
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one line per outage, with the backlog size
    assert "record(s) wait in" in warnings[0] and server.uri in warnings[0]

    server.start()
    _log_steps(tracker, range(41, 51))
    assert tracker.finish("FINISHED", timeout=60)
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    _assert_each_point_once(server.uri, tracker.run_id, 50)
    run = MlflowClient(server.uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"trainer.lr": "0.001"}
    assert run.data.tags["mtprun.plan_hash"] == "h"
    artifacts = {a.path for a in MlflowClient(server.uri).list_artifacts(tracker.run_id)}
    assert {"recipe.yaml", "samples"} <= artifacts


def test_a_server_down_until_the_end_bounds_shutdown_then_sync_uploads(server, tmp_path):
    run_dir = RunDir(tmp_path / "run").create()
    spool = Spool(run_dir.tracking_spool)
    tracker = Tracker.start(server.uri, "exp", "late", {}, spool=spool)
    run_dir.write_state({"tracking_uri": server.uri, "run_id": tracker.run_id})
    _log_steps(tracker, range(1, 6))
    _wait(lambda: tracker.backlog == 0)

    server.stop()
    _log_steps(tracker, range(6, 31))
    tracker.set_tags({"mtprun.checkpoint": "step_30"})
    began = time.monotonic()
    assert not tracker.finish("FAILED", "boom", timeout=3)
    waited = time.monotonic() - began
    assert waited < 4.5, f"shutdown waited {waited:.1f} s on a dead server (timeout 3 s)"
    assert Spool(run_dir.tracking_spool).backlog == 28  # 25 steps, tags, error tag, status

    down = _sync(run_dir.root, "--timeout", "2")
    assert down.returncode == 1 and "28 record(s) remain" in down.stderr

    server.start()
    done = _sync(run_dir.root)
    assert done.returncode == 0, done.stderr
    assert "uploaded 28 tracking record(s)" in done.stdout
    _assert_each_point_once(server.uri, tracker.run_id, 30)
    run = MlflowClient(server.uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["mtprun.error"] == "boom"
    assert run.data.tags["mtprun.checkpoint"] == "step_30"
    again = _sync(run_dir.root)
    assert again.returncode == 0 and "uploaded 0 tracking record(s)" in again.stdout


def _sync(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MTPRUN, "sync", str(root), *args], env=ENV, capture_output=True, text=True, timeout=120
    )


def test_a_record_uploaded_twice_is_one_point(tmp_path):
    """A writer killed between an upload and its cursor write sends the records again."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker.start(uri, "exp", "twice", {}, spool=Spool(tmp_path / "a"))
    spool = Spool(tmp_path / "b")
    for step in (1, 2, 3):
        spool.append({"op": "metrics", "step": step, "ts": 1000 + step, "values": {"m": step}})
    records, _ = spool.read()
    upload(tracker.client, tracker.run_id, records)  # on the server, cursor not moved
    again = Tracker.reopen(uri, tracker.run_id, tracker.experiment_id, spool)
    assert again.finish("FINISHED", timeout=30)
    history = MlflowClient(uri).get_metric_history(tracker.run_id, "m")
    assert sorted(m.step for m in history) == [1, 2, 3]


def test_the_spool_keeps_order_survives_a_torn_tail_and_stays_bounded(tmp_path):
    spool = Spool(tmp_path, limit_bytes=400)
    for step in (1, 2, 3):
        assert spool.append({"op": "metrics", "step": step, "ts": step, "values": {"m": 1.0}})
    records, offsets = spool.read()
    spool.commit(offsets[0], 1, 1)
    spool.close()
    with open(spool.path, "ab") as f:
        f.write(b'{"op":"metrics","step":4,"ts"')  # a process killed mid-append

    reopened = Spool(tmp_path, limit_bytes=400)
    assert reopened.backlog == 2 and reopened.last_step == 3
    assert [r["step"] for r in reopened.read()[0]] == [2, 3]
    big = {"op": "text", "name": "x", "text": "y" * 400}
    assert not reopened.append(big)  # past the bound: refused, nothing written
    assert reopened.append({"op": "status", "status": "FAILED", "ts": 1}, essential=True)
    records, offsets = reopened.read()
    assert [r["op"] for r in records] == ["metrics", "metrics", "status"]
    reopened.commit(offsets[-1], 3, 3)
    assert reopened.backlog == 0 and reopened.path.stat().st_size == 0
    assert Spool(tmp_path).last_step == 3  # known after the file is emptied


def test_a_new_run_without_its_server_exits_1_and_can_start_again(tmp_path, capsys):
    """Only the start needs the server (it creates the MLflow run); the folder stays usable."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel: {tiny: {architecture: qwen2, hidden: 64, heads: 2, kv_heads: 1}}\n"
        f"data: {{source: arithmetic}}\ntracking: {{uri: 'http://127.0.0.1:{free_port()}'}}\n"
        f"run_dir: {tmp_path / 'run'}\n"
    )
    assert main(["run", str(recipe)]) == 1
    assert "cannot create the MLflow run at http://127.0.0.1:" in capsys.readouterr().err
    assert not RunDir(tmp_path / "run").has_run()
    RunLock(tmp_path / "run").acquire().release()  # released on the way out


def test_a_step_with_more_metrics_than_one_mlflow_call_takes(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker.start(uri, "exp", "wide", {}, spool=Spool(tmp_path / "tracking"))
    tracker.log_metrics(1, {f"m/{i}": float(i) for i in range(1500)})  # MLflow takes 1000
    assert tracker.finish("FINISHED", timeout=30)
    assert len(MlflowClient(uri).get_run(tracker.run_id).data.metrics) == 1500
