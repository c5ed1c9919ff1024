"""Ray for a run folder: join a cluster, or start a local instance whose files stay in the
run's temp folder."""

from __future__ import annotations

import logging
import os

import ray

from mtprun.runner.run.run_dir import RunDir
from mtprun.spec import Recipe

log = logging.getLogger("mtprun")


def connect_ray(recipe: Recipe, run_dir: RunDir, address: str | None) -> None:
    address = address or recipe.resources.ray_address
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=False)
        return
    res = recipe.resources
    temp_dir = run_dir.ray_temp_dir()
    log.info("starting a local Ray instance (temp folder %s)", temp_dir)
    ray.init(
        num_cpus=res.num_cpus,
        num_gpus=res.num_gpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(temp_dir),
    )
