"""A new run's local MLflow store copied from the cache's empty one
(`mtprun.runner.tracking.sqlite_seed`): the copy holds what a store MLflow makes holds (its
schema, migration version and default experiment, owned by this process), the empty store is
made once, an existing store is never touched, and a cache turned off or not writable leaves
MLflow to make the store."""

from __future__ import annotations

import logging
import sqlite3
import uuid
from pathlib import Path

import mlflow
from mlflow import MlflowClient

from mtprun.runner.cache import CACHE_ENV
from mtprun.runner.tracking.sqlite_seed import seed_sqlite_store

LOGGER = "mtprun.runner.tracking.sqlite_seed"


def _store(folder: Path) -> str:
    return f"sqlite:///{folder / 'mlflow.db'}"


def _contents(uri: str) -> dict[str, object]:
    """The schema, the migration version and the default experiment, without its times. A
    table's definition as the set of its lines: the second store MLflow makes in a process
    lists the runs table's constraints in another order than the first."""
    with sqlite3.connect(uri.removeprefix("sqlite:///")) as db:
        rows = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        schema = [
            (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
            for kind, name, sql in rows
        ]
        version = db.execute("SELECT version_num FROM alembic_version").fetchall()
        default = db.execute(
            "SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments"
        ).fetchall()
    return {"schema": schema, "version": version, "experiments": default}


def test_a_seeded_store_holds_what_mlflow_makes_and_takes_a_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default experiment's artifacts: ./mlruns of this process
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    made = _store(tmp_path / "made")
    (tmp_path / "made").mkdir()
    MlflowClient(tracking_uri=made).search_experiments()
    seeded = [_store(tmp_path / f"run{i}") for i in range(2)]
    for uri in seeded:
        seed_sqlite_store(uri)
        assert _contents(uri) == _contents(made)
    made_once = [p.name for p in (tmp_path / "cache" / "mlflow").iterdir()]
    assert made_once == [f"empty-{mlflow.__version__}.db"]  # no scratch left
    client = MlflowClient(tracking_uri=seeded[0])
    name = f"e-{uuid.uuid4().hex[:8]}"
    run = client.create_run(client.create_experiment(name))
    client.log_metric(run.info.run_id, "loss", 0.5, step=1)
    assert client.get_metric_history(run.info.run_id, "loss")[0].value == 0.5
    assert client.get_experiment_by_name(name).experiment_id == "1"


def test_an_existing_store_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    uri = _store(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("kept")
    seed_sqlite_store(uri)
    assert client.get_experiment_by_name("kept") is not None
    assert not (tmp_path / "cache").exists()


def test_without_a_usable_cache_mlflow_makes_the_store(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, "")
    seed_sqlite_store(_store(tmp_path / "off"))
    assert not (tmp_path / "off" / "mlflow.db").exists()  # left to MLflow
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    uri = _store(tmp_path / "blocked")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        seed_sqlite_store(uri)
    assert "MLflow store cache" in caplog.text and "not usable" in caplog.text
    assert not (tmp_path / "blocked" / "mlflow.db").exists()
    (tmp_path / "blocked").mkdir(exist_ok=True)
    assert MlflowClient(tracking_uri=uri).get_experiment("0").name == "Default"
