"""A trainer rank SIGKILLed mid-run: the run restarts the trainer from the newest checkpoint
and finishes every step once (`train/restarts` = 1); with `trainer.max_restarts: 0` it fails
naming the cause. Real `mtprun` console script, Ray, Megatron-core and MLflow."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from mtprun.runner.run.driver import EXIT_STOPPED

from .cli_run import (
    E2E_TINY,
    RunRecord,
    actor_pids,
    finish,
    start,
    still_running,
    wait_for_log,
    write_recipe,
)

pytestmark = pytest.mark.slow

STEPS = 60


def _recipe(run_dir: Path, max_restarts: int) -> dict:
    return {
        "name": "restart",
        "model": {"tiny": E2E_TINY},
        "data": {"source": "arithmetic", "template": "chatml", "packing_length": 128},
        "trainer": {
            "steps": STEPS,
            "lr": 1e-3,
            "micro_batch_tokens": 128,
            "checkpoint_every": 5,
            "max_restarts": max_restarts,
        },
        "resources": {"num_cpus": 2},
        "run_dir": str(run_dir),
    }


def _run_and_kill_the_trainer(max_restarts: int):
    """The run, its trainer SIGKILLed after its first checkpoint: (exit code, output, log,
    killed pid, run folder). The folder is removed by the caller."""
    root = Path(tempfile.mkdtemp(prefix="rst", dir="/tmp"))  # short: Ray's sockets
    run_dir = root / "run"
    proc = start(write_recipe(root, _recipe(run_dir, max_restarts)), cwd=root)
    log_file = run_dir / "log.txt"
    pid = int(wait_for_log(log_file, r"trainer ready: 1 rank\(s\), pids \[(\d+)\]", proc)[1])
    wait_for_log(log_file, r"checkpoint: .*step_000005", proc)
    os.kill(pid, signal.SIGKILL)
    code, out = finish(proc)
    return code, out, log_file.read_text(), pid, run_dir


def test_a_killed_trainer_restarts_from_its_checkpoint_and_every_step_runs_once():
    code, out, log, killed, run_dir = _run_and_kill_the_trainer(max_restarts=2)
    try:
        assert code == 0, out[-3000:]
        assert f"trainer rank 0 (pid {killed}) died" in log
        restarted = re.search(r"restarting the trainer from step (\d+) \(restart 1 of 2\)", log)
        assert restarted and int(restarted[1]) >= 5, log[-3000:]  # its newest checkpoint
        assert len(re.findall(r"trainer ready: 1 rank\(s\)", log)) == 2
        record = RunRecord(run_dir)
        assert record.run.info.status == "FINISHED"
        assert record.steps("train/loss") == list(range(1, STEPS + 1))  # once each
        restarts = record.values("train/restarts")
        assert restarts[0] == 0 and restarts[-1] == 1
        assert still_running(actor_pids(log)) == set()
    finally:
        shutil.rmtree(run_dir.parent, ignore_errors=True)


def test_past_max_restarts_the_run_fails_with_the_cause():
    code, out, _, killed, run_dir = _run_and_kill_the_trainer(max_restarts=0)
    try:
        assert code == 1, out[-3000:]
        record = RunRecord(run_dir)
        assert record.run.info.status == "FAILED"
        error = record.run.data.tags["mtprun.error"]
        assert f"trainer rank 0 (pid {killed}) died" in error
        assert "trainer.max_restarts" in error
    finally:
        shutil.rmtree(run_dir.parent, ignore_errors=True)


def test_sigterm_stops_after_a_step_with_a_checkpoint_and_resume_finishes():
    """Ray's driver replaces the SIGTERM handler when it connects; mtprun's graceful stop must
    still get the signal (a regression: the run used to die with SystemExit 15, unsaved)."""
    root = Path(tempfile.mkdtemp(prefix="trm", dir="/tmp"))
    run_dir = root / "run"
    try:
        proc = start(write_recipe(root, _recipe(run_dir, max_restarts=2)), cwd=root)
        log_file = run_dir / "log.txt"
        wait_for_log(log_file, r"checkpoint: .*step_000005", proc)
        os.kill(proc.pid, signal.SIGTERM)
        code, out = finish(proc)
        assert code == EXIT_STOPPED, out[-3000:]
        stopped = re.search(r"stopped after step (\d+); continue with", log_file.read_text())
        assert stopped, log_file.read_text()[-3000:]
        assert f"step_{int(stopped[1]):06d}" in log_file.read_text()  # its checkpoint
        code, out = finish(start("resume", run_dir, cwd=root))
        assert code == 0, out[-3000:]
        record = RunRecord(run_dir)
        assert record.run.info.status == "FINISHED"
        assert record.steps("train/loss") == list(range(1, STEPS + 1))  # once each
    finally:
        shutil.rmtree(root, ignore_errors=True)
