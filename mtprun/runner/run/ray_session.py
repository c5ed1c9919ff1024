"""Ray for a run folder: join a cluster, or start a local instance whose files stay in the
run's temp folder; either way, one that cannot hold the run's actors is refused before any
actor starts (Ray would leave an actor it cannot place waiting forever).

A local start on a loaded machine can fail: Ray gives its raylet a fixed 30 s to register with
the GCS (`ray/_private/node.py`), and on two busy cores it once took longer (CI, 2026-11-28).
That start is retried after its processes are stopped (Ray leaves them running)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import ray

from mtprun.runner.run_dir import RunDir
from mtprun.spec import Recipe
from mtprun.spec.actors import ActorDemand

log = logging.getLogger("mtprun")


def connect_ray(recipe: Recipe, run_dir: RunDir, address: str | None, demand: ActorDemand) -> None:
    """Ray joined or started, holding `demand` (else ClusterTooSmall)."""
    address = address or recipe.resources.ray_address
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=False)
        wait_for_capacity(demand, recipe.resources.wait_for_resources_s, address)
        return
    res = recipe.resources
    temp_dir = run_dir.ray_temp_dir()
    log.info("starting a local Ray instance (temp folder %s)", temp_dir)

    def start() -> None:
        ray.init(
            num_cpus=res.num_cpus,
            num_gpus=res.num_gpus,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=str(temp_dir),
        )

    start_with_retries(start, lambda: stop_processes_of(temp_dir))
    wait_for_capacity(demand, 0, None)


LOCAL_START_ATTEMPTS = 3


def is_startup_timeout(error: BaseException) -> bool:
    """Whether `error` is Ray's "node timed out during startup" (a bare Exception; its text is
    all that tells it apart)."""
    return "timed out during startup" in str(error)


class RayStartTimeout(RuntimeError):
    """The local Ray instance timed out at every start attempt."""


def start_with_retries(
    start: Callable[[], None], cleanup: Callable[[], None], attempts: int = LOCAL_START_ATTEMPTS
) -> None:
    """Runs `start` until it returns; after a startup timeout, `cleanup` and start again, up
    to `attempts` times in all. Any other error is raised as it is; the last timeout as
    RayStartTimeout."""
    for attempt in range(1, attempts + 1):
        try:
            start()
            return
        except Exception as error:
            if not is_startup_timeout(error):
                raise
            if attempt == attempts:
                raise RayStartTimeout(
                    f"the local Ray instance did not come up in {attempts} attempts of Ray's "
                    f"30 s ({error}): the machine is too busy to start it; free some cores, or "
                    "start Ray yourself (`ray start --head`) and pass --ray-address"
                ) from error
            log.warning(
                "the local Ray instance did not come up within Ray's 30 s (attempt %d of %d; "
                "the machine is busy): stopping its processes and starting it again",
                attempt,
                attempts,
            )
            cleanup()


def stop_processes_of(temp_dir: Path, wait_s: float = 10.0) -> int:
    """Kills this process's children whose command line names `temp_dir` (the GCS, raylet
    and monitors a local start spawned there), and their own children; returns how many."""
    folder = str(temp_dir)
    doomed: list[psutil.Process] = []
    for child in psutil.Process().children():
        try:
            if any(folder in arg for arg in child.cmdline()):
                doomed += [child, *child.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for process in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(doomed, timeout=wait_s)
    return len(doomed)


class ClusterTooSmall(RuntimeError):
    """The Ray cluster (or local instance) holds fewer CPUs or GPUs than the run's actors need
    at once."""


def wait_for_capacity(
    demand: ActorDemand, wait_s: float, address: str | None, poll_s: float = 5.0
) -> None:
    """Returns once Ray's resource totals hold `demand`; ClusterTooSmall after `wait_s`
    seconds (a cluster may grow while an autoscaler adds nodes; `address` None is the local
    instance, which never does)."""
    deadline = time.monotonic() + wait_s
    next_note = time.monotonic()
    while True:
        have = ray.cluster_resources()
        short = demand.short_of(have)
        if not short:
            return
        where = f"the Ray cluster at {address}" if address else "the local Ray instance"
        if time.monotonic() >= deadline:
            resource = short[0]
            waited = f" (after waiting {wait_s:g} s)" if wait_s else ""
            raise ClusterTooSmall(
                demand.shortfall_message(resource, have.get(resource, 0.0), where + waited)
            )
        if time.monotonic() >= next_note:
            log.info(
                "waiting up to %g s for %s to hold %s (resources.wait_for_resources_s)",
                wait_s,
                where,
                ", ".join(f"{demand.need(r):g} {r}s (has {have.get(r, 0):g})" for r in short),
            )
            next_note = time.monotonic() + 30
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
