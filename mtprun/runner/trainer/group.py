"""The trainer ranks as one object: every call goes to all ranks at once (their collectives
must meet). The last rank answers for losses (it holds the last pipeline stage, where they are
computed), each data-parallel replica's last rank for the log-probs of its share of the
batches; rank 0 holds the gathered weights.

A rank whose process dies (OOM kill, lost node) surfaces as TrainerDied as soon as Ray
notices, even while the other ranks wait for it in a collective: the driver then starts a new
group from the newest checkpoint (Driver._restart_trainer)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from mtprun.runner.actors import stop_actors, torch_threads
from mtprun.runner.placement import Placement
from mtprun.runner.trainer.parallel import data_parallel_replica
from mtprun.runner.trainer.worker import TrainerWorker


class TrainerGroup:
    """actors[r] is trainer rank r, of data-parallel replica `data_parallel_replica(r)`; the
    ranks of one replica get the same micro batches. The last ranks hold the last pipeline
    stage."""

    def __init__(self, actors: list[Any], parallel: Any, seed: int) -> None:
        self.actors = actors
        # With asynchronous rollouts two driver threads call the group (the rollout thread
        # only to re-sync a restarted engine); every rank must see the calls in one order.
        self.lock = threading.RLock()
        self.version = 0  # the global step of the weights it holds (the driver sets it)
        self.sync_bytes = 0  # the size of the last weights_ref's payload
        self.dp = parallel.dp
        self.replica = [data_parallel_replica(rank, parallel) for rank in range(len(actors))]
        self.pids = [0] * len(actors)
        address = self._gather([actors[0].rendezvous_address.remote()])[0]
        self.pids = self._gather([a.setup.remote(parallel, seed, *address) for a in actors])

    @classmethod
    def start(cls, recipe: Any, placement: Placement | None = None) -> TrainerGroup:
        """One actor per trainer rank (tp*pp*cp*dp), placed by `placement` (the recipe's by
        default)."""
        placement = placement or Placement(recipe)
        par = recipe.parallel
        world = par.tp * par.pp * par.cp * par.dp
        remote = ray.remote(TrainerWorker)
        threads = torch_threads(recipe, world)
        actors = [
            remote.options(**placement.trainer_options(rank), max_restarts=0).remote(
                rank, world, threads
            )
            for rank in range(world)
        ]
        return cls(actors, par, recipe.seed)

    def build(self, recipe: Any, model_dir: str, plan_json: str, with_reference: bool) -> None:
        self._all("build", recipe, model_dir, plan_json, with_reference)

    def _all(self, method: str, *args: Any) -> list[Any]:
        with self.lock:
            return self._gather([getattr(a, method).remote(*args) for a in self.actors])

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's result, in rank order; TrainerDied as soon as one rank's process is
        gone (ray.get of the list would wait on a survivor stuck in a collective)."""
        results: dict[int, Any] = {}
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = index[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as err:
                raise TrainerDied(rank, self.pids[rank], err) from err
            except Exception:
                # A survivor's collective fails when its peer dies; blame the death, not that.
                self._raise_if_one_died()
                raise
        return [results[rank] for rank in range(len(refs))]

    def _raise_if_one_died(self, grace_s: float = 10.0) -> None:
        """TrainerDied for a rank whose process is gone, checked within `grace_s`."""
        probes = [a.pid.remote() for a in self.actors]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=grace_s)
        for ref in ready:
            rank = probes.index(ref)
            try:
                ray.get(ref, timeout=grace_s)
            except RayActorError as err:
                raise TrainerDied(rank, self.pids[rank], err) from err
            except GetTimeoutError:
                continue

    def train_step(
        self, micro_batches: list[Any], replica_of: list[int] | None = None
    ) -> dict[str, float]:
        """One optimizer step; micro batch i goes to data-parallel replica replica_of[i]
        (`mtprun.data.balance`), by default i % dp: replica d trains micro batches d, d+dp, ..."""
        _, shares = self._shares(micro_batches, replica_of)
        if not all(shares):
            raise ValueError(
                f"{len(micro_batches)} micro batches for {self.dp} data-parallel replicas: "
                "lower trainer.micro_batch_tokens or raise the batch (task.prompts_per_step)"
            )
        with self.lock:
            refs = [
                actor.train_step.remote(shares[d])
                for actor, d in zip(self.actors, self.replica, strict=True)
            ]
            metrics = self._gather(refs)[-1]
            self.version += 1
        return metrics

    def logprobs(
        self, batches: list[Any], reference: bool = False, replica_of: list[int] | None = None
    ) -> list[Any]:
        """Per batch its [T] log-probs (the policy's, or the frozen reference's). Each
        data-parallel replica computes those of its own batches, replica_of[i] (the ones it
        trains; by default i % dp); its last rank, of the last pipeline stage, answers."""
        replica_of, shares = self._shares(batches, replica_of)
        if not all(shares):  # fewer batches than replicas: every replica computes them all
            return self._all("logprobs", batches, reference)[-1]
        with self.lock:
            refs = [
                actor.logprobs.remote(shares[d], reference)
                for actor, d in zip(self.actors, self.replica, strict=True)
            ]
            answers = dict(zip(self.replica, self._gather(refs), strict=True))  # last rank wins
        own = {d: iter(answers[d]) for d in range(self.dp)}
        return [next(own[d]) for d in replica_of]

    def _shares(
        self, batches: list[Any], replica_of: list[int] | None
    ) -> tuple[list[int], list[list[Any]]]:
        """The replica of each batch (`replica_of`, by default i % dp) and each replica's
        batches, in order."""
        if replica_of is None:
            replica_of = [i % self.dp for i in range(len(batches))]
        if len(replica_of) != len(batches):
            raise ValueError(f"{len(replica_of)} replicas for {len(batches)} micro batches")
        shares: list[list[Any]] = [[] for _ in range(self.dp)]
        for batch, replica in zip(batches, replica_of, strict=True):
            shares[replica].append(batch)
        return replica_of, shares

    def weights_ref(self) -> Any:
        """ObjectRef of rank 0's weight-sync payload (the full HF weights, or with LoRA the
        adapters), for the rollout engines to fetch; `sync_bytes` becomes its size."""
        with self.lock:
            calls = [a.sync_weights.options(num_returns=2).remote() for a in self.actors]
            # Every rank's size (0 but rank 0's): all have returned, and rank 0's weights,
            # returned beside its size, stay in Ray's object store.
            self.sync_bytes = self._gather([size for _, size in calls])[0]
            return calls[0][0]

    def offload(self) -> dict[str, float]:
        """Colocated: every rank's optimizer state to the host, its gradients released."""
        results = self._all("offload")
        return {
            "time/offload_s": max(s for s, _ in results),
            "memory/offloaded_gib": max(b for _, b in results) / 2**30,
        }

    def onload(self) -> float:
        return max(self._all("onload"))

    def shared_parts(self) -> Iterator[list[Any]]:
        """Colocated: the sync payload a part at a time, each rank's copy of the part packed
        on its GPU (TrainerWorker.share_next_part): yields the part's CUDA IPC handles in rank
        order, valid until the next part is asked for; `sync_bytes` becomes the parts' total.
        Closing it part way takes the ranks to the stream's end (they gather each part
        together) and frees the last part's buckets."""
        self.sync_bytes = 0
        try:  # at the end each rank has freed its last part and closed its stream
            while (shared := self._all("share_next_part"))[0] is not None:
                self.sync_bytes += shared[0][1]
                yield [handles for handles, _ in shared]
        except TrainerDied:
            raise  # the group is restarted, its ranks' streams with it
        except BaseException:  # closed or failed part way (GeneratorExit included)
            self._all("release_shared")
            raise

    def transfer_address(self) -> tuple[str, int]:
        """Where the engines join rank 0's weight-transfer group."""
        return self._gather([self.actors[0].transfer_address.remote()])[0]

    def form_transfer(self, generation: int, world_size: int) -> None:
        """Rank 0 forms the group's `generation` as member 0 (the engines' joins must be under
        way); returns once every member joined. TrainerDied when rank 0 dies meanwhile."""
        self._gather([self.actors[0].form_transfer.remote(generation, world_size)])

    def send_weights(self) -> int:
        """Broadcast the weights from rank 0 to the transfer group (its members receive at
        the same time); returns the bytes each member got."""
        return self._all("send_weights")[0]

    def save(self, folder: str) -> dict[str, float]:
        """Every rank writes its part into `folder`; returns rank 0's seconds per part."""
        return self._all("save", folder)[0]

    def load(self, folder: str) -> int:
        return self._all("load", folder)[0]

    def shutdown(self) -> None:
        stop_actors(self.actors)

    def kill(self) -> None:
        """End every rank now: survivors of a dead rank may be stuck in a collective, where a
        polite shutdown call would wait behind it."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class TrainerDied(RuntimeError):
    """A trainer rank's process ended (killed, out of memory, node lost)."""

    def __init__(self, rank: int, pid: int, cause: BaseException) -> None:
        self.rank = rank
        self.pid = pid
        super().__init__(f"trainer rank {rank} (pid {pid}) died: {type(cause).__name__}")
