"""The colocated loop's handovers: each GPU goes from the engines to the trainer and back.

With `resources.placement: colocate` engine i and trainer rank i share a GPU and take turns
(the synchronous loop: the spec refuses colocation with rollout.max_staleness > 0). After a
step's rollouts the engines sleep (KV cache and weights released) and the trainer's optimizer
state comes back from the host; after the step the trainer's optimizer state goes to the host
again and its gradients are released, and then the weight sync wakes the engines: their
weights first, the trainer's packed copy of the weights freed, their KV cache last. A
checkpoint between steps takes the same turn (`with_trainer_state`).
"""

from __future__ import annotations

from collections.abc import Callable

from mtprun.runner.rollout.pool import RolloutPool
from mtprun.runner.run.weight_sync import WeightSync
from mtprun.runner.trainer.group import TrainerGroup


class Colocation:
    def __init__(
        self, trainer: Callable[[], TrainerGroup], pool: RolloutPool, sync: WeightSync
    ) -> None:
        self._trainer = trainer  # the current group: a trainer restart replaces it
        self.pool = pool
        self.sync = sync

    def to_trainer(self) -> dict[str, float]:
        """The engines sleep, the trainer's state returns to the GPU."""
        sleep_s = self.pool.sleep()
        return {"time/engine_sleep_s": sleep_s, "time/onload_s": self._trainer().onload()}

    def to_engines(self) -> dict[str, float]:
        """The trainer's state to the host, before the sync that wakes the engines."""
        return self._trainer().offload()

    def with_trainer_state(self, action: Callable[[], None]) -> None:
        """`action` (a checkpoint's save) with the trainer's whole state on its GPUs: the
        engines sleep meanwhile and are woken by a sync of the same weights after."""
        self.to_trainer()
        action()
        self.to_engines()
        self.sync.push()
