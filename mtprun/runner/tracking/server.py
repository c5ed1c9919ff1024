"""A local `mlflow server` process: started on a store, waited for until it answers, stopped
with its workers. `mtprun ui` serves a run's store with it; the tracking-outage tests and the
chaos soak stop and start one to play a tracking server that goes away."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mtprun.runner.net import check_listenable, free_port
from mtprun.runner.tracking.sqlite_seed import seed_sqlite_store

# The server's optional job runner (MLflow 3) is not used and would start workers of its own.
_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class MlflowServer:
    """`mlflow server` on `store_uri` at host:port (a free port when None), in a process group
    of its own so that `stop` reaches its workers; its output goes to `log` (None: inherited).
    Can be started again after a stop, on the same port and store."""

    def __init__(
        self,
        store_uri: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        artifacts: Path | None = None,
        log: Path | None = None,
    ) -> None:
        self.store_uri, self.host, self.port = store_uri, host, port or free_port(host)
        self.artifacts, self.log = artifacts, log
        self.uri = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def runs_view(self, experiment_id: str) -> str:
        """The UI's address of an experiment's training runs (MLflow 3's "Training runs" tab;
        the bare server address opens MLflow's home page instead)."""
        return f"{self.uri}/#/experiments/{experiment_id}/runs"

    def run_page(self, experiment_id: str, run_id: str) -> str:
        """The UI's address of one run of an experiment."""
        return f"{self.runs_view(experiment_id)}/{run_id}"

    def start(self, timeout_s: float = 180.0) -> None:
        """Start the server and return once it answers /health; raises PortUnavailable at
        once when its port is taken (an earlier `mtprun ui`'s server there would answer the
        health check in its place), RuntimeError (with the end of its log) when it exits or
        does not answer within `timeout_s`."""
        check_listenable(self.host, self.port)
        seed_sqlite_store(self.store_uri)  # a new store without MLflow's migrations
        command = [
            *(sys.executable, "-m", "mlflow", "server", "--host", self.host),
            *("--port", str(self.port), "--workers", "1"),
            *("--backend-store-uri", self.store_uri),
        ]
        if self.artifacts is not None:
            command += ["--artifacts-destination", str(self.artifacts)]
        out = open(self.log, "ab") if self.log else None  # noqa: SIM115 (the server's lifetime)
        self.proc = subprocess.Popen(
            command, stdout=out, stderr=out, env={**os.environ, **_ENV}, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.uri}/health", timeout=1)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}){self._tail()}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server not up after {timeout_s:.0f} s at {self.uri}")

    def wait(self) -> int:
        """Block until the server exits; its exit code."""
        assert self.proc is not None, "start() the server first"
        return self.proc.wait()

    def stop(self) -> None:
        """Stop the server and its workers (its whole process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # workers that outlived the server
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return ":\n" + self.log.read_text(errors="replace")[-2000:]
