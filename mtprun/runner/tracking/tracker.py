"""MLflow tracking: one MLflow run per recipe run, reopened (same run id) on resume.

Every record goes to the run folder's spool first and reaches MLflow from a background
thread (`tracking_writer`), so an unreachable server never stops training.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from mtprun.runner.run_dir import RunDir
from mtprun.runner.tracking.spool import Spool
from mtprun.runner.tracking.sqlite_seed import seed_sqlite_store
from mtprun.runner.tracking.writer import TrackingWriter, fail_fast_http

# MLflow rejects param values longer than this; longer ones are cut and marked.
_MAX_PARAM_LEN = 6000

log = logging.getLogger("mtprun")


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts/lists -> {"a.b.0.c": "value"}; the recipe's params in MLflow."""
    if isinstance(tree, Mapping):
        items = [(f"{prefix}{k}", v) for k, v in tree.items()]
    elif isinstance(tree, list | tuple) and tree:
        items = [(f"{prefix}{i}", v) for i, v in enumerate(tree)]
    else:
        return {prefix.rstrip("."): str(tree)}
    flat: dict[str, str] = {}
    for key, value in items:
        flat.update(flatten(value, f"{key}."))
    return flat


def git_commit(cwd: Path | None = None) -> str:
    """The checkout's commit (with -dirty), or "unknown" outside a git tree."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"],
            cwd=cwd or Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


class Tracker:
    """One MLflow run, written through the run folder's spool by a background writer: no
    call here waits on the tracking server, except `start` (the run must be created) and the
    bounded `finish`."""

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str, spool: Spool) -> None:
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.spool = spool
        self._dropped = 0  # records dropped since the spool last took one
        self.writer = TrackingWriter(spool, client, run_id).start()

    @classmethod
    def start(
        cls,
        uri: str,
        experiment: str,
        run_name: str,
        tags: Mapping[str, str],
        artifact_root: Path | None = None,
        *,
        spool: Spool,
    ) -> Tracker:
        """Create a new run. `artifact_root` places a new experiment's artifacts (local stores)."""
        fail_fast_http()
        seed_sqlite_store(uri)
        client = MlflowClient(tracking_uri=uri)
        try:
            found = client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                location = artifact_root.resolve().as_uri() if artifact_root else None
                experiment_id = client.create_experiment(experiment, artifact_location=location)
            run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
        except MlflowException as err:
            raise TrackingUnavailable(
                f"cannot create the MLflow run at {uri}: {err}; a new run needs its tracking "
                "server once, at the start (later outages are spooled)"
            ) from err
        return cls(client, run.info.run_id, experiment_id, spool)

    @classmethod
    def reopen(cls, uri: str, run_id: str, experiment_id: str, spool: Spool) -> Tracker:
        """Continue a run after `mtprun resume`: it goes back to RUNNING. Records a previous
        process left in the spool upload first."""
        fail_fast_http()
        tracker = cls(MlflowClient(tracking_uri=uri), run_id, experiment_id, spool)
        tracker._append({"op": "status", "status": "RUNNING", "ts": _now_ms()}, essential=True)
        return tracker

    @property
    def backlog(self) -> int:
        """Records spooled and not yet on the server."""
        return self.spool.backlog

    @property
    def outage(self) -> str | None:
        """Why the server is unreachable, while it is; else None."""
        return self.writer.outage

    def log_params(self, params: Mapping[str, str]) -> None:
        values = {k: _cut(str(v)) for k, v in params.items()}
        self._append({"op": "params", "values": values})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._append({"op": "tags", "values": {k: _cut(str(v)) for k, v in tags.items()}})

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        # The timestamp is fixed here, so a record uploaded twice is one point in MLflow.
        values = {k: float(v) for k, v in sorted(metrics.items())}
        self._append({"op": "metrics", "step": step, "ts": _now_ms(), "values": values})

    def last_logged_step(self) -> int:
        """Highest metrics step this run ever logged (spooled or uploaded), 0 when none; asks
        the server only for a run folder that predates the spool."""
        if self.spool.existed or self.spool.last_step:
            return self.spool.last_step
        history = self.client.get_metric_history(self.run_id, "train/loss")
        return max((m.step for m in history), default=0)

    def log_artifact(self, path: Path, folder: str | None = None) -> None:
        """`path` is read at upload time: pass files that stay as they are."""
        self._append({"op": "artifact", "path": str(Path(path).resolve()), "folder": folder})

    def log_text(self, text: str, name: str) -> None:
        self._append({"op": "text", "text": text, "name": name})

    def finish(self, status: str, error: str | None = None, timeout: float = 30.0) -> bool:
        """status: FINISHED, FAILED or KILLED; the error text lands in tag `mtprun.error`.
        Waits at most `timeout` seconds for the upload; True when everything is on the server,
        else the rest stays in the spool for `mtprun sync` / `mtprun resume`."""
        if error:
            self._append({"op": "tags", "values": {"mtprun.error": _cut(error)}}, essential=True)
        self._append({"op": "status", "status": status, "ts": _now_ms()}, essential=True)
        return self.close(timeout)

    def close(self, timeout: float) -> bool:
        """Stop the writer after at most `timeout` seconds of uploading; True when drained."""
        drained = self.writer.close(timeout)
        self.spool.close()
        if not drained:
            log.warning(
                "tracking: %d record(s) not uploaded to %s (%s); they stay in %s: upload them "
                "with `mtprun sync %s` once the server is back (or `mtprun resume` does)",
                self.spool.backlog,
                self.client.tracking_uri,
                self.writer.outage or f"still uploading after {timeout:g} s",
                self.spool.path,
                self.spool.folder.parent,
            )
        return drained

    def _append(self, record: dict[str, Any], essential: bool = False) -> None:
        try:
            kept = self.spool.append(record, essential)
        except (OSError, ValueError) as err:  # disk full, spool closed: never stop training
            kept = False
            reason = f"cannot write {self.spool.path}: {err}"
        else:
            reason = (
                f"the backlog reached tracking.spool_limit_mib ({self.spool.limit_bytes >> 20} MiB)"
            )
        if kept:
            self.writer.wake()
            if self._dropped:
                log.warning("tracking: recording again after dropping %d record(s)", self._dropped)
                self._dropped = 0
            return
        if not self._dropped:  # said once per episode, not once a step
            log.error("tracking: %s; new records are dropped until there is room", reason)
        self._dropped += 1


class TrackingUnavailable(RuntimeError):
    """The tracking server could not be reached where it must be."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_PARAM_LEN else text[: _MAX_PARAM_LEN - 12] + "...[cut]"


def sync_spool(run_root: Path, timeout: float) -> tuple[int, int]:
    """Upload what a run's spool holds (a stopped run, or one that lost its server) within
    `timeout` seconds; returns (records uploaded, records left). The caller holds the run
    folder's lock, so no live run uploads the same records."""
    run_dir = RunDir(run_root)
    state = run_dir.read_state()
    if not run_dir.tracking_spool.exists():
        return 0, 0
    fail_fast_http()
    spool = Spool(run_dir.tracking_spool)
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    writer = TrackingWriter(spool, client, state["run_id"], meanwhile="retrying until --timeout")
    try:
        writer.start().close(timeout)
    finally:
        spool.close()
    return writer.uploaded, spool.backlog
