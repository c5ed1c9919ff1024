"""A trainer rank SIGKILLed mid-run: the run restarts the trainer from the newest checkpoint
and finishes every step once (`train/restarts` = 1); with `trainer.max_restarts: 0` it fails
naming the cause. A SIGTERM then stops the restarted run after a step with a checkpoint, and
`mtprun resume` finishes it. Real `mtprun` console script, Ray, Megatron-core and MLflow."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
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

# The trainer is killed at its step-5 checkpoint and the run SIGTERMed at the restarted trainer's
# first one (step 10; it stopped after step 11 on a loaded 2-core machine): 30 steps leave the
# SIGTERM ~20 steps (0.05-0.3 s each) to land before the run's end, and the resume ~20 to run.
STEPS = 30
_TRAINER_READY = r"trainer ready: 1 rank\(s\), pids \[(\d+)\]"


def _recipe(run_dir: Path, max_restarts: int) -> dict:
    return {
        "name": "restart",
        "model": {"tiny": E2E_TINY},
        # 256 examples: 52 packed rows, more than the steps take; the default 2048 cost each
        # of the module's three `mtprun` starts ~10 CPU-s more to render and count.
        "data": {
            "source": "arithmetic",
            "template": "chatml",
            "packing_length": 128,
            "num_samples": 256,
        },
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


def _start_and_kill_the_trainer(root: Path, max_restarts: int):
    """The run started in `root`, its trainer SIGKILLed after its first checkpoint: (the
    `mtprun` process, the killed pid, the run folder)."""
    run_dir = root / "run"
    proc = start(write_recipe(root, _recipe(run_dir, max_restarts)), cwd=root)
    log_file = run_dir / "log.txt"
    pid = int(wait_for_log(log_file, _TRAINER_READY, proc)[1])
    wait_for_log(log_file, r"checkpoint: .*step_000005", proc)
    os.kill(pid, signal.SIGKILL)
    return proc, pid, run_dir


@pytest.fixture(scope="module")
def restarted_run() -> Iterator[dict]:
    """One run for the restart and the SIGTERM: its trainer killed after step 5, then, once
    the restarted trainer checkpointed, the run SIGTERMed and resumed to its end. What the
    first attempt and the resume did."""
    root = Path(tempfile.mkdtemp(prefix="rst", dir="/tmp"))  # short: Ray's sockets
    try:
        proc, killed, run_dir = _start_and_kill_the_trainer(root, max_restarts=2)
        log_file = run_dir / "log.txt"
        restarted = wait_for_log(log_file, r"restarting the trainer from step (\d+)", proc)
        ready = wait_for_log(log_file, _TRAINER_READY, proc, since=restarted.end())
        wait_for_log(log_file, r"checkpoint: .*step_\d+", proc, since=ready.end())
        os.kill(proc.pid, signal.SIGTERM)
        code, out = finish(proc)
        first_log = log_file.read_text()
        resumed = finish(start("resume", run_dir, cwd=root))
        yield {
            "run_dir": run_dir,
            "killed": killed,
            "first": (code, out, first_log),
            "resume": resumed,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_killed_trainer_restarts_from_its_checkpoint_and_every_step_runs_once(restarted_run):
    _, out, log = restarted_run["first"]
    killed = restarted_run["killed"]
    assert f"trainer rank 0 (pid {killed}) died" in log, out[-3000:]
    restarted = re.search(r"restarting the trainer from step (\d+) \(restart 1 of 2\)", log)
    assert restarted and int(restarted[1]) >= 5, log[-3000:]  # its newest checkpoint
    assert len(re.findall(r"trainer ready: 1 rank\(s\)", log)) == 2
    code, out = restarted_run["resume"]
    assert code == 0, out[-3000:]
    record = RunRecord(restarted_run["run_dir"])
    assert record.run.info.status == "FINISHED"
    assert record.steps("train/loss") == list(range(1, STEPS + 1))  # once each
    # The first attempt's count: it started at 0 and was 1 when the SIGTERM stopped it.
    stopped = int(re.search(r"stopped after step (\d+)", log)[1])
    restarts = record.values("train/restarts")
    assert restarts[0] == 0 and restarts[stopped - 1] == 1
    assert still_running(actor_pids(log)) == set()


def test_past_max_restarts_the_run_fails_with_the_cause():
    root = Path(tempfile.mkdtemp(prefix="rst", dir="/tmp"))  # short: Ray's sockets
    try:
        proc, killed, run_dir = _start_and_kill_the_trainer(root, max_restarts=0)
        code, out = finish(proc)
        assert code == 1, out[-3000:]
        record = RunRecord(run_dir)
        assert record.run.info.status == "FAILED"
        error = record.run.data.tags["mtprun.error"]
        assert f"trainer rank 0 (pid {killed}) died" in error
        assert "trainer.max_restarts" in error
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_sigterm_stops_after_a_step_with_a_checkpoint_and_resume_finishes(restarted_run):
    """Ray's driver replaces the SIGTERM handler when it connects; mtprun's graceful stop must
    still get the signal (a regression: the run used to die with SystemExit 15, unsaved)."""
    code, out, log = restarted_run["first"]
    assert code == EXIT_STOPPED, out[-3000:]
    stopped = re.search(r"stopped after step (\d+); continue with", log)
    assert stopped, log[-3000:]
    assert f"step_{int(stopped[1]):06d}" in log  # its checkpoint
    code, out = restarted_run["resume"]
    assert code == 0, out[-3000:]
    record = RunRecord(restarted_run["run_dir"])
    assert record.run.info.status == "FINISHED"
    assert record.steps("train/loss") == list(range(1, STEPS + 1))  # once each
