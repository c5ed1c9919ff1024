"""Helpers of the end-to-end runner tests: run the real `mtprun` console script, follow its
log, read the run back through the MLflow client."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from mlflow import MlflowClient

MTPRUN = [str(Path(sys.executable).with_name("mtprun"))]  # the installed console script
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def write_recipe(folder: Path, recipe: dict) -> Path:
    path = folder / f"{recipe['name']}.yaml"
    path.write_text(json.dumps(recipe, indent=2))  # JSON is YAML
    return path


def start(*args: str | Path, cwd: Path) -> subprocess.Popen:
    """`mtprun ARGS` in its own session, so signals sent to it reach only it."""
    return subprocess.Popen(
        [*MTPRUN, *map(str, args)],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


# The tiny policy of the end-to-end runs: small enough for 2 CPU cores, head size 32.
E2E_TINY = {
    "architecture": "qwen2",
    "hidden": 64,
    "layers": 2,
    "heads": 2,
    "kv_heads": 1,
    "intermediate": 128,
    "max_seq_len": 128,
}

# Hang guards, not timing assertions: vLLM and Ray start in seconds on an idle 2-core machine
# but took minutes when it was shared with other test runs.
HANG_GUARD_S = 900


def finish(proc: subprocess.Popen, timeout: float = HANG_GUARD_S) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@contextlib.contextmanager
def finished_run(recipe: Path, *overrides: str, prefix: str) -> Iterator[RunRecord]:
    """`recipe` with `overrides` run to its end in a new folder under /tmp (short: Ray's Unix
    sockets live under <run_dir>/ray); its MLflow record, the folder removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        run_dir = root / "run"
        code, out = finish(start(recipe, f"run_dir={run_dir}", *overrides, cwd=root))
        assert code == 0, out[-3000:]
        yield RunRecord(run_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def log_size(log_file: Path) -> int:
    return len(log_file.read_text()) if log_file.exists() else 0


def wait_for_log(
    log_file: Path,
    pattern: str,
    proc: subprocess.Popen,
    since: int = 0,
    timeout: float = HANG_GUARD_S,
) -> re.Match:
    """The first match of `pattern` in the run's log after character `since` (the log is
    appended by every attempt), waiting while `proc` runs."""
    deadline = time.monotonic() + timeout
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        if log_file.exists():
            found = regex.search(log_file.read_text(), since)
            if found:
                return found
        if proc.poll() is not None:
            raise AssertionError(f"mtprun exited ({proc.returncode}) before logging {pattern!r}")
        time.sleep(0.1)  # the runs' steps are short: a signal sent on a match lands soon
    raise AssertionError(f"no {pattern!r} in {log_file} after {timeout} s")


_ACTOR_PIDS = re.compile(r"ready: (?:\d+ rank\(s\), )?pids \[([\d, ]+)\]|new pid (\d+)")


def actor_pids(log: str) -> set[int]:
    """Process ids of every actor the run's log reports (trainer ranks, engines, restarts)."""
    pids: set[int] = set()
    for found in _ACTOR_PIDS.finditer(log):
        pids.update(int(p) for p in (found.group(1) or found.group(2)).split(", "))
    return pids


def still_running(pids: set[int], grace_s: float = 30) -> set[int]:
    """The processes of `pids` still alive after giving exiting ones `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = {pid for pid in pids if Path(f"/proc/{pid}").exists()}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(1)


class RunRecord:
    """The MLflow side of a finished run folder."""

    def __init__(self, run_dir: Path) -> None:
        state = json.loads((run_dir / "state.json").read_text())
        self.client = MlflowClient(state["tracking_uri"])
        self.run_id = state["run_id"]
        self.run = self.client.get_run(self.run_id)

    def steps(self, key: str) -> list[int]:
        return sorted(m.step for m in self.client.get_metric_history(self.run_id, key))

    def values(self, key: str) -> list[float]:
        history = sorted(self.client.get_metric_history(self.run_id, key), key=lambda m: m.step)
        return [m.value for m in history]

    def artifacts(self, folder: str | None = None) -> set[str]:
        return {a.path for a in self.client.list_artifacts(self.run_id, folder)}
