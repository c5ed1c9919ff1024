"""What the trainer ranks and the rollout engines share as Ray actors: stopping them and
sizing their CPU threads. The actor classes live beside their engines
(`trainer.worker.TrainerWorker`, `rollout.worker.RolloutWorker`)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("mtprun")


def stop_actors(actors: list[Any], timeout_s: float = 60) -> None:
    """Ask each actor to release its engine, then kill its process (also a dead or hung one)."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.shutdown.remote(), timeout=timeout_s)
        except Exception as err:  # dead or hung: the kill below still ends it
            log.debug("actor shutdown: %s", err)
        ray.kill(actor, no_restart=True)


def torch_threads(recipe: Any, actors: int) -> int | None:
    """CPU threads per actor of a group of `actors` (the trainer ranks, or the engines). On
    CPU the trainer and the engines take turns in the synchronous loop, so each group may use
    the cluster's cores; with asynchronous rollouts they run at once and share them. With
    GPUs torch's default stands."""
    import ray

    resources = recipe.resources
    if resources.gpus_per_actor > 0:
        return None
    actors_at_once = actors
    if recipe.rollout.max_staleness > 0 and recipe.task is not None:
        parallel = recipe.parallel
        trainer_ranks = parallel.tp * parallel.pp * parallel.cp * parallel.dp
        actors_at_once = trainer_ranks + recipe.rollout.num_engines
    cpus = min(os.cpu_count() or 1, int(ray.cluster_resources().get("CPU", 1)))
    return max(1, cpus // max(1, actors_at_once))
