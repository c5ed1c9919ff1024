"""`mtprun ui`: a real local MLflow server on a run's store, opened on the training runs of the
run's experiment."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mlflow import MlflowClient

from mtprun.cli import main
from mtprun.runner.net import free_port
from mtprun.runner.run_dir import RunDir
from mtprun.runner.tracking.sqlite_seed import seed_sqlite_store

MTPRUN = Path(sys.executable).parent / "mtprun"  # the installed console script


def _run_folder(root: Path) -> tuple[Path, str, str]:
    """A run folder whose store holds its run in the recipe's experiment, created after
    another so that its id is not the first; its state written by an mtprun without the
    experiment id in state.json: (folder, experiment id, run id)."""
    uri = f"sqlite:///{root / 'mlflow.db'}"
    seed_sqlite_store(uri)  # as a run's store starts: without MLflow's migrations
    client = MlflowClient(uri)
    client.create_experiment("someone-else", artifact_location=str(root / "a0"))
    experiment_id = client.create_experiment("my-recipes", artifact_location=str(root / "a1"))
    run_id = client.create_run(experiment_id, run_name="sft-7").info.run_id
    run_dir = RunDir(root / "run").create()
    run_dir.write_state({"tracking_uri": uri, "run_id": run_id})
    return run_dir.root, experiment_id, run_id


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _wait_healthy(address: str, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "mtprun ui exited before serving"
        try:
            with urllib.request.urlopen(f"{address}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{address}/health did not answer in {timeout} s")


def test_ui_opens_the_training_runs_of_the_runs_experiment(tmp_path):
    run_dir, experiment_id, run_id = _run_folder(tmp_path)
    port = free_port()
    ui = subprocess.Popen(
        [MTPRUN, "ui", "--port", str(port), run_dir],  # options before the folder
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        address = f"http://127.0.0.1:{port}"
        runs_view = f"{address}/#/experiments/{experiment_id}/runs"
        assert ui.stdout.readline().strip() == f"MLflow UI for {run_dir}: {runs_view}"
        assert ui.stdout.readline().strip() == f"run {run_id}: {runs_view}/{run_id}"
        _wait_healthy(address, ui)
        # The server's experiment of that id is the recipe's, and it holds the run.
        api = f"{address}/api/2.0/mlflow"
        experiment = _get(f"{api}/experiments/get?experiment_id={experiment_id}")
        assert experiment["experiment"]["name"] == "my-recipes"
        request = urllib.request.Request(
            f"{api}/runs/search",
            data=json.dumps({"experiment_ids": [experiment_id]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            runs = json.loads(response.read())["runs"]
        assert [r["info"]["run_id"] for r in runs] == [run_id]
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        assert ui.wait(timeout=30) == 0  # SIGTERM stops it cleanly


def test_a_run_missing_from_its_store_is_refused(tmp_path, capsys):
    run_dir, _, _ = _run_folder(tmp_path)
    state = json.loads((run_dir / "state.json").read_text())
    RunDir(run_dir).write_state({**state, "run_id": "0123456789abcdef"})
    assert main(["ui", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "mtprun ui: the run 0123456789abcdef is not in its store sqlite:///" in err


def test_ui_on_a_port_in_use_says_so_and_exits_1(tmp_path, capsys):
    run_dir, _, _ = _run_folder(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["ui", str(run_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"mtprun ui: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "choose another with --port" in err


def test_ui_on_an_address_not_of_this_machine_says_so_and_exits_1(tmp_path, capsys):
    run_dir, _, _ = _run_folder(tmp_path)
    # 192.0.2.0/24 is reserved for documentation (RFC 5737): no interface has it.
    assert main(["ui", str(run_dir), "--host", "192.0.2.1", "--port", str(free_port())]) == 1
    assert "cannot listen on 192.0.2.1:" in capsys.readouterr().err
