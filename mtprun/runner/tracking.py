"""MLflow tracking: one MLflow run per recipe run, reopened (same run id) on resume."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag

# MLflow rejects param values longer than this; longer ones are cut and marked.
_MAX_PARAM_LEN = 6000
_BATCH = 100  # MLflow's per-call limit on params/metrics is larger; stay well under it


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
    """Thin wrapper over MlflowClient bound to one run."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    @classmethod
    def start(
        cls,
        uri: str,
        experiment: str,
        run_name: str,
        tags: Mapping[str, str],
        artifact_root: Path | None = None,
    ) -> Tracker:
        """Create a new run. `artifact_root` places a new experiment's artifacts (local stores)."""
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = artifact_root.resolve().as_uri() if artifact_root else None
            experiment_id = client.create_experiment(experiment, artifact_location=location)
        run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
        return cls(client, run.info.run_id)

    @classmethod
    def reopen(cls, uri: str, run_id: str) -> Tracker:
        """Continue a run after `mtprun resume`: it goes back to RUNNING."""
        client = MlflowClient(tracking_uri=uri)
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        return cls(client, run_id)

    @property
    def experiment_id(self) -> str:
        return self.client.get_run(self.run_id).info.experiment_id

    def log_params(self, params: Mapping[str, str]) -> None:
        items = [Param(k, _cut(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _BATCH])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + _BATCH])

    def last_logged_step(self, key: str) -> int:
        """Highest step of `key` in the run, 0 when never logged."""
        history = self.client.get_metric_history(self.run_id, key)
        return max((m.step for m in history), default=0)

    def log_artifact(self, path: Path, folder: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), folder)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def finish(self, status: str, error: str | None = None) -> None:
        """status: FINISHED, FAILED or KILLED; the error text lands in tag `mtprun.error`."""
        if error:
            self.set_tags({"mtprun.error": _cut(error)})
        self.client.set_terminated(self.run_id, status=status)


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_PARAM_LEN else text[: _MAX_PARAM_LEN - 12] + "...[cut]"
