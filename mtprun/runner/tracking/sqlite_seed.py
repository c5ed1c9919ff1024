"""`seed_sqlite_store`: a new local MLflow store copied from an empty one kept in the cache.

MLflow makes a new sqlite store's tables by running its schema migrations one by one, ~3 CPU
seconds (6 s on a 2-core machine beside other work); every run folder holds a store of its
own, so every run paid that before its first step. An empty store is made once per MLflow
version, in `mlflow/` of mtprun's cache directory (`mtprun.runner.cache.add_to_cache`), and
copied into each new run. The
copy's default experiment (id 0, which MLflow makes with every store) gets the artifact
location and time a store made by this process would have given it. Without a cache, or one
that cannot be written, MLflow makes the store itself, as before.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time
from pathlib import Path

import mlflow
from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

from mtprun.runner.cache import add_to_cache, cache_root

log = logging.getLogger(__name__)

_SQLITE = "sqlite:///"


def seed_sqlite_store(uri: str) -> None:
    """Before MLflow first opens `uri`: where it names a sqlite file that does not exist yet,
    write the cache's empty store there (see the module docstring)."""
    root = cache_root()
    if not uri.startswith(_SQLITE) or root is None:
        return
    path = Path(uri[len(_SQLITE) :])
    if path.exists() or str(path) == ":memory:":
        return
    template = root / "mlflow" / f"empty-{mlflow.__version__}.db"
    try:
        if not template.exists():
            add_to_cache(template, _empty_store)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
    except OSError as error:
        log.warning("MLflow store cache %s not usable (%s): MLflow makes the store", root, error)
        path.unlink(missing_ok=True)
        return
    _own_default_experiment(path)


def _empty_store(scratch: Path) -> Path:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"{_SQLITE}{scratch / 'mlflow.db'}", str(scratch / "mlruns"))
    store.engine.dispose()
    return scratch / "mlflow.db"


def _own_default_experiment(path: Path) -> None:
    """Experiment 0 as MLflow would make it here: under ./mlruns of this process, made now."""
    location = append_to_uri_path(resolve_uri_if_local(DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH), "0")
    now = int(time.time() * 1000)
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE experiments SET artifact_location = ?, creation_time = ?, "
            "last_update_time = ? WHERE experiment_id = 0",
            (str(location), now, now),
        )
    db.close()
