"""Where the trainer ranks and the rollout engines run: Ray scheduling options for each actor.

`split` (the default): every actor asks Ray for `resources.gpus_per_actor` GPUs of its own.
`colocate`: one Ray placement group of one bundle per trainer rank, each bundle one GPU (and
both actors' CPUs); trainer rank i and engine i each take half of bundle i's GPU, so Ray gives
them the same device (a bundle's single GPU), never two trainer ranks on one GPU as plain
fractional requests could. Ray restarts a dead engine in its bundle, beside its rank again.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("mtprun")

_PLACEMENT_TIMEOUT_S = 600.0


class Placement:
    def __init__(self, recipe: Any) -> None:
        self.resources = recipe.resources
        self.colocate = self.resources.placement == "colocate" and recipe.task is not None
        # Plain fractional requests: Ray may put two actors (trainer, engine, reward model) on
        # one GPU.
        self.fractional_gpus = 0 < self.resources.gpus_per_actor < 1
        self.group: Any = None
        if self.colocate:
            self.group = _bundles(recipe.parallel.world_size, self.resources.cpus_per_actor)

    def trainer_options(self, rank: int) -> dict[str, Any]:
        return self._options(rank)

    def engine_options(self, index: int) -> dict[str, Any]:
        return self._options(index)

    def _options(self, bundle: int) -> dict[str, Any]:
        res = self.resources
        if not self.colocate:
            return {"num_cpus": res.cpus_per_actor, "num_gpus": res.gpus_per_actor}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": res.cpus_per_actor,
            "num_gpus": 0.5,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle
            ),
        }

    def remove(self) -> None:
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def _bundles(count: int, cpus_per_actor: float) -> Any:
    """A placement group of `count` bundles of one GPU and two actors' CPUs each, ready."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([{"GPU": 1, "CPU": 2 * cpus_per_actor}] * count, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
    if not ready:
        raise RuntimeError(
            f"resources.placement colocate: Ray could not reserve {count} GPU(s) with "
            f"{2 * cpus_per_actor:g} CPUs each within {_PLACEMENT_TIMEOUT_S:.0f} s (cluster: "
            f"{ray.cluster_resources()}); give Ray more GPUs or use fewer trainer ranks"
        )
    log.info("colocated placement: %d GPU bundle(s), a trainer rank and an engine on each", count)
    return group
