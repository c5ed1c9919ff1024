"""Starting a run (new run folder, new MLflow run) and resuming one (same folder, same run)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from mtprun.runner.run.driver import Driver
from mtprun.runner.run.lock import RunFolderError, RunLock
from mtprun.runner.run.progress import close_logging, setup_logging
from mtprun.runner.run.stages import plan_stages
from mtprun.runner.run_dir import RunDir
from mtprun.runner.tracking.spool import Spool
from mtprun.runner.tracking.tracker import Tracker, flatten, git_commit
from mtprun.spec import Recipe

log = logging.getLogger("mtprun")

__all__ = ["RunFolderError", "resume_run", "start_run"]


def start_run(recipe: Recipe, recipe_text: str, ray_address: str | None, console: Console) -> int:
    """A new run in `recipe.run_dir`, which must not hold one yet; the folder stays locked
    (RunLock) until the run ends."""
    run_dir = RunDir(Path(recipe.run_dir))
    run_dir.root.mkdir(parents=True, exist_ok=True)
    with RunLock(run_dir.root).acquire("mtprun run"):
        return _start_locked(recipe, recipe_text, run_dir, ray_address, console)


def _start_locked(
    recipe: Recipe, recipe_text: str, run_dir: RunDir, ray_address: str | None, console: Console
) -> int:
    if run_dir.has_run():
        raise RunFolderError(
            f"{run_dir.root} already holds a run; continue it with `mtprun resume "
            f"{run_dir.root}`, or start a new one elsewhere with the override run_dir=PATH"
        )
    run_dir.create()
    setup_logging(run_dir.log_file, console)
    try:
        stages = plan_stages(recipe)
        run_dir.recipe_yaml.write_text(recipe_text)
        run_dir.recipe_json.write_text(recipe.model_dump_json(indent=2))
        plan = stages[-1].plan
        run_dir.plan_json.write_text(plan.to_json())

        uri = _absolute_tracking_uri(recipe.tracking.uri or run_dir.default_tracking_uri)
        local_store = uri.startswith("sqlite:") or uri.startswith("file:")
        tracker = Tracker.start(
            uri,
            recipe.tracking.experiment,
            run_name=recipe.name,
            tags={
                "mtprun.git_commit": git_commit(),
                "mtprun.plan_hash": plan.hash,
                "mtprun.run_dir": str(run_dir.root),
            },
            artifact_root=run_dir.artifact_root if local_store else None,
            spool=_spool(run_dir, recipe),
        )
        run_dir.write_state(
            {"tracking_uri": uri, "run_id": tracker.run_id, "experiment_id": tracker.experiment_id}
        )
        tracker.log_params(flatten(recipe.model_dump(mode="json")))
        tracker.log_artifact(run_dir.recipe_yaml)
        tracker.log_artifact(run_dir.plan_json)
        for stage in stages:
            tracker.log_text(stage.plan.to_json(), f"plans/{stage.name}.json")
        log.info(
            "run %s: folder %s, MLflow run %s (see it with: mtprun ui %s)",
            recipe.name,
            run_dir.root,
            tracker.run_id,
            run_dir.root,
        )
        return Driver(recipe, run_dir, tracker, console).execute(ray_address)
    finally:
        close_logging()


def resume_run(path: Path, ray_address: str | None, console: Console) -> int:
    """Continue the run in `path` from its newest checkpoint, into the same MLflow run."""
    run_dir = RunDir(path)
    state = run_dir.read_state()
    with RunLock(run_dir.root).acquire("mtprun resume"):
        return _resume_locked(run_dir, state, ray_address, console)


def _resume_locked(
    run_dir: RunDir, state: dict[str, Any], ray_address: str | None, console: Console
) -> int:
    recipe = Recipe.model_validate_json(run_dir.recipe_json.read_text())
    setup_logging(run_dir.log_file, console)
    try:
        spool = _spool(run_dir, recipe)
        if spool.backlog:
            log.info("tracking: uploading %d record(s) a previous attempt left", spool.backlog)
        tracker = Tracker.reopen(
            state["tracking_uri"], state["run_id"], state.get("experiment_id", ""), spool
        )
        log.info("resuming run %s in %s (MLflow run %s)", recipe.name, run_dir.root, tracker.run_id)
        return Driver(recipe, run_dir, tracker, console).execute(ray_address)
    finally:
        close_logging()


def _spool(run_dir: RunDir, recipe: Recipe) -> Spool:
    return Spool(run_dir.tracking_spool, recipe.tracking.spool_limit_mib << 20)


def _absolute_tracking_uri(uri: str) -> str:
    """sqlite:///relative/path -> sqlite:////abs/path, so a resume from elsewhere finds it."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri
