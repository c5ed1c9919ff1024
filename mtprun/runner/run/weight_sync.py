"""The trainer's weights into every rollout engine after an optimizer step.

`collective` (the default): trainer rank 0 broadcasts the gathered HF weights over the
transfer group (mtprun/runner/weight_transfer.py), formed again whenever its members changed
(a restarted engine or trainer is a new process: it joins the next generation of the group).
`object_store`: rank 0 puts them into Ray's object store and each engine fetches them.
`cuda_ipc` (colocated placement): each trainer rank packs them on its GPU a few layers at a time
and the engine beside it copies each part from there through CUDA IPC handles
(mtprun/runner/cuda_ipc.py) before the rank packs the next.
With LoRA (`model.lora`) both move the adapters alone: the engines keep the frozen base they
started from (TrainerWorker._sync_parts, RolloutEngine.update_weights).

An engine restarted mid-step is brought to the trainer's current weights through the object
store (the broadcast needs every member; the engine rejoins the group at the next sync); a
formation or broadcast that fails because an engine died is finished the same way for that
step (a formation waits for a dead member up to weight_transfer.FORM_TIMEOUT).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from mtprun.runner.rollout.pool import RolloutPool
from mtprun.runner.trainer.group import TrainerDied, TrainerGroup

log = logging.getLogger("mtprun")


class WeightSync:
    def __init__(self, method: str, trainer: Callable[[], TrainerGroup], pool: RolloutPool):
        self.method = method
        self._trainer = trainer  # the current group: a trainer restart replaces it
        self.pool = pool
        self._generation = 0
        self._members: tuple[int, ...] | None = None  # pids of the formed group's members
        if method == "collective":
            pool.resync = self._resync_from_trainer
        elif method == "cuda_ipc":
            pool.resync = self._resync_through_cuda_ipc

    def push(self) -> dict[str, float]:
        """The trainer's weights (policy version `trainer.version`) into every engine; the
        driver-side seconds, the slowest engine's seconds inside vLLM and the bytes each
        engine received."""
        trainer = self._trainer()
        start = time.perf_counter()
        if self.method == "collective":
            engine_s, sent = self._broadcast(trainer)
        elif self.method == "cuda_ipc":
            engine_s, sent = self._through_cuda_ipc(trainer)
        else:
            engine_s, sent = self._through_object_store(trainer)
        return {
            "time/sync_s": time.perf_counter() - start,
            "time/engine_sync_s": engine_s,
            "sync/bytes": float(sent),
        }

    def _through_object_store(self, trainer: TrainerGroup) -> tuple[float, int]:
        engine_s = self.pool.update_weights(trainer.weights_ref(), trainer.version)
        return engine_s, trainer.sync_bytes

    def _through_cuda_ipc(self, trainer: TrainerGroup) -> tuple[float, int]:
        """Colocated: each trainer rank packs the weights on its GPU a few layers at a time,
        the engine beside it copies each part from there before the rank packs the next."""
        with trainer.lock:
            engine_s = self.pool.update_weights_in_parts(trainer.shared_parts(), trainer.version)
        # The KV caches last, into the memory the buckets held.
        return engine_s + self.pool.wake_up(), trainer.sync_bytes

    def _resync_through_cuda_ipc(self, engine: int) -> float:
        """A restarted colocated engine gets its rank's current weights, streamed into it
        alone (its peers take the ranks' parts too and drop them)."""
        trainer = self._trainer()
        with trainer.lock:
            seconds, dead = self.pool.stream_update(
                trainer.shared_parts(), trainer.version, [engine]
            )
        if dead:
            raise RuntimeError(f"rollout engine {engine} died again while it was re-synced")
        actor: Any = self.pool.actors[engine]
        return seconds[engine] + ray.get(actor.wake_up.remote())

    def _broadcast(self, trainer: TrainerGroup) -> tuple[float, int]:
        self.pool.revive()  # a dead member would hold the group's formation until its timeout
        try:
            if self._members != (trainer.pids[0], *self.pool.pids):
                self._form(trainer)  # an engine dying as it joins fails this after FORM_TIMEOUT
            receipts = self.pool.receive_weights(trainer.version)
            sent = trainer.send_weights()
            return max(reload_s for _, reload_s in ray.get(receipts)), sent
        except TrainerDied:
            raise
        except Exception as err:
            if not self.pool.revive():
                raise
            log.warning(
                "a rollout engine died while the weight-transfer group formed or broadcast "
                "(%s); this step's weights go through the object store, the group forms again "
                "at the next sync",
                type(err).__name__,
            )
            self._members = None
            return self._through_object_store(trainer)

    def _form(self, trainer: TrainerGroup) -> None:
        """A new generation of the transfer group: trainer rank 0 and every engine."""
        self._generation += 1
        address = trainer.transfer_address()
        world = len(self.pool.actors) + 1
        joins = self.pool.join_transfer(address, self._generation)
        trainer.form_transfer(self._generation, world)  # a dead trainer: TrainerDied, restarted
        ray.get(joins)
        self._members = (trainer.pids[0], *self.pool.pids)
        log.info(
            "weight-transfer group %d formed: trainer rank 0 and %d engine(s) at %s:%d",
            self._generation,
            world - 1,
            *address,
        )

    def _resync_from_trainer(self, engine: int) -> float:
        """A restarted engine gets the trainer's current weights (waiting for a step in
        progress: never a half-updated model), as the version they are."""
        trainer = self._trainer()
        with trainer.lock:
            ref, version = trainer.weights_ref(), trainer.version
        actor: Any = self.pool.actors[engine]
        return ray.get(actor.update_weights.remote(ref, version))
