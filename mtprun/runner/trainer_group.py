"""The trainer ranks as one object: every call goes to all ranks at once (their collectives
must meet). The last rank answers for losses and log-probs (it holds the last pipeline stage,
where they are computed); rank 0 holds the gathered weights."""

from __future__ import annotations

from typing import Any

import ray

from mtprun.runner.actors import TrainerWorker, stop_actors, torch_threads
from mtprun.runner.parallel import data_parallel_replica


class TrainerGroup:
    """actors[r] is trainer rank r, of data-parallel replica `data_parallel_replica(r)`; the
    ranks of one replica get the same micro batches. The last ranks hold the last pipeline
    stage."""

    def __init__(self, actors: list[Any], parallel: Any, seed: int) -> None:
        self.actors = actors
        self.dp = parallel.dp
        self.replica = [data_parallel_replica(rank, parallel) for rank in range(len(actors))]
        address = ray.get(actors[0].rendezvous_address.remote())
        self.pids = ray.get([a.setup.remote(parallel, seed, *address) for a in actors])

    @classmethod
    def start(cls, recipe: Any) -> TrainerGroup:
        """One actor per trainer rank (tp*pp*cp*dp), with the recipe's resources."""
        res, par = recipe.resources, recipe.parallel
        world = par.tp * par.pp * par.cp * par.dp
        remote = ray.remote(TrainerWorker).options(
            num_cpus=res.cpus_per_actor, num_gpus=res.gpus_per_actor, max_restarts=0
        )
        threads = torch_threads(res, world)
        return cls([remote.remote(rank, world, threads) for rank in range(world)], par, recipe.seed)

    def build(self, recipe: Any, model_dir: str, plan_json: str, with_reference: bool) -> None:
        self._all("build", recipe, model_dir, plan_json, with_reference)

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def train_step(self, micro_batches: list[Any]) -> dict[str, float]:
        """One optimizer step; data-parallel replica d trains micro batches d, d+dp, ..."""
        if len(micro_batches) < self.dp:
            raise ValueError(
                f"{len(micro_batches)} micro batches for {self.dp} data-parallel replicas: "
                "lower trainer.micro_batch_tokens or raise the batch (task.prompts_per_step)"
            )
        refs = [
            actor.train_step.remote(micro_batches[d :: self.dp])
            for actor, d in zip(self.actors, self.replica, strict=True)
        ]
        return ray.get(refs)[-1]

    def logprobs(self, batches: list[Any], reference: bool = False) -> list[Any]:
        return self._all("logprobs", batches, reference)[-1]

    def weights_ref(self) -> Any:
        """ObjectRef of the full HF weights (rank 0's), for the rollout engines to fetch."""
        refs = [a.hf_state_dict.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs))  # every rank took part in the gather
        return refs[0]

    def save(self, folder: str) -> None:
        self._all("save", folder)

    def load(self, folder: str) -> int:
        return self._all("load", folder)[0]

    def shutdown(self) -> None:
        stop_actors(self.actors)
