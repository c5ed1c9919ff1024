"""`mtprun eval RUN_DIR [--step N]`: the recipe's evaluation of a saved checkpoint.

The checkpoint's policy is served by the recipe's rollout engines (on Ray, like a run) and
evaluated as `eval:` says (its defaults when the recipe has none). The metrics are written
to `RUN_DIR/eval/step_N.json` and logged to the run's MLflow run at step N.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import ray
from mlflow import MlflowClient
from mlflow.entities import Metric

from mtprun.runner.rollout.episodes import EpisodeCollector
from mtprun.runner.rollout.pool import RolloutPool
from mtprun.runner.run import checkpoint
from mtprun.runner.run.evaluation import Evaluator
from mtprun.runner.run.lock import RunLock
from mtprun.runner.run.ray_session import connect_ray
from mtprun.runner.run_dir import RunDir, write_json_atomic
from mtprun.spec import Recipe
from mtprun.spec.actors import ActorDemand
from mtprun.spec.eval import EvalSection

log = logging.getLogger("mtprun")


def evaluate_checkpoint(
    path: Path, step: int | None, ray_address: str | None
) -> tuple[int, dict[str, float]]:
    """(step, eval metrics) of checkpoint `step` (the newest when None) of the run in `path`."""
    run_dir = RunDir(path)
    state = run_dir.read_state()
    with RunLock(run_dir.root).acquire("mtprun eval"):
        step = step if step is not None else checkpoint.latest(run_dir.checkpoints)
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {run_dir.checkpoints} yet")
        policy = checkpoint.step_dir(run_dir.checkpoints, step) / "hf"
        if not policy.is_dir():
            raise FileNotFoundError(f"no checkpoint for step {step} in {run_dir.checkpoints}")
        recipe = Recipe.model_validate_json(run_dir.recipe_json.read_text())
        if recipe.task is None:
            raise ValueError(f"{run_dir.root} ran SFT (no `task:`): there is no reward to evaluate")
        if recipe.eval is None:
            recipe = recipe.model_copy(update={"eval": EvalSection()})
        metrics = _evaluate(recipe, run_dir, policy, ray_address)
        write_json_atomic(run_dir.root / "eval" / f"step_{step}.json", metrics)
        _log(state, step, metrics)
    return step, metrics


def _evaluate(
    recipe: Recipe, run_dir: RunDir, policy: Path, ray_address: str | None
) -> dict[str, float]:
    (run_dir.root / "eval").mkdir(exist_ok=True)
    engines_only = replace(ActorDemand.of(recipe), trainer_ranks=0)  # no trainer here
    connect_ray(recipe, run_dir, ray_address, engines_only)
    pool = collector = None
    try:
        pool = RolloutPool.launch(recipe, policy, run_dir.vllm_dir).ready()
        collector = EpisodeCollector(recipe, policy, pool)
        return Evaluator(recipe, collector).evaluate()
    finally:
        if collector is not None:
            collector.close()
        if pool is not None:
            pool.shutdown()
        ray.shutdown()


def _log(state: dict, step: int, metrics: dict[str, float]) -> None:
    """The metrics into the run's MLflow run at `step` (its status is left as it is)."""
    try:
        client = MlflowClient(tracking_uri=state["tracking_uri"])
        stamp = int(time.time() * 1000)
        client.log_batch(
            state["run_id"], metrics=[Metric(k, v, stamp, step) for k, v in metrics.items()]
        )
    except Exception as err:  # the metrics are in eval/step_N.json either way
        log.warning("could not log the evaluation to MLflow: %s", err)
