"""Rollouts of the coming steps, generated in a background thread while the trainer trains.

With `rollout.max_staleness: k`, step s may be generated as soon as the engines serve policy
version s - 1 - k (the weights after global step s - 1 - k), and the weight sync that installs
version v waits until step v + k is generated: the engines alternate one step's generation
and one weight sync, and no sync lands inside a step's generation (a multi-turn episode is
sampled by one policy). So step s is sampled by exactly version max(s - 1 - k, the version the
loop started from): staleness k from the (k+1)-th step of a loop on, while the trainer trains
step s - 1 .. s - k. With k = 0 it is the synchronous loop: generate s, train s, sync s.

With partial rollouts (`rollout.partial`) the generation calls `pause_point` between chunks:
a sync waiting there runs at once, inside the step's generation, and the generation goes on
with the new weights (rollout/partial.py), so tokens of step s may be sampled by versions
newer than s - 1 - k, never older.

The thread calls only the engines; the driver thread calls the trainer, and the engines only
for the weight sync, while no generation runs (or one is paused). (An engine restarted
mid-generation is synced from the trainer, see run/weight_sync.py: its episodes then record
the newer version.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Generated(Generic[T]):
    value: T
    generate_s: float  # the generation's own seconds
    wait_s: float  # how long the trainer waited for it


class RolloutsAhead(Generic[T]):
    """`generate(step)` for first_step..last_step in order, at most `k` steps ahead."""

    def __init__(
        self, generate: Callable[[int], T], k: int, first_step: int, last_step: int
    ) -> None:
        self.k = k
        self._generate = generate
        self._last = last_step
        self._cond = threading.Condition()
        self._synced = first_step - 1  # the policy version the engines serve
        self._done: dict[int, tuple[T | BaseException, float]] = {}
        self._done_through = first_step - 1  # every step up to here is generated (or failed)
        self._closed = False
        self._sync_waiting = False  # the driver waits in before_sync
        self._paused = False  # the generation waits in pause_point for that sync
        self._thread = threading.Thread(
            target=self._run, args=(first_step,), name="mtprun-rollouts", daemon=True
        )
        self._thread.start()

    def _run(self, first_step: int) -> None:
        for step in range(first_step, self._last + 1):
            with self._cond:
                self._cond.wait_for(lambda s=step: self._closed or self._synced >= s - 1 - self.k)
                if self._closed:
                    return
            start = time.perf_counter()
            try:
                value: T | BaseException = self._generate(step)
            except BaseException as err:  # handed to the driver thread by take()
                value = err
            with self._cond:
                self._done[step] = (value, time.perf_counter() - start)
                self._done_through = step
                self._cond.notify_all()
            if isinstance(value, BaseException):
                return

    def take(self, step: int) -> Generated[T]:
        """Step `step`'s rollouts, waiting for them; the generation's error, raised here."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: step in self._done)
            value, seconds = self._done.pop(step)
        if isinstance(value, BaseException):
            raise value
        return Generated(value, seconds, time.perf_counter() - start)

    def before_sync(self, version: int) -> float:
        """Wait until every step generated with the weights before `version` is done (steps up
        to version + k); returns the seconds waited. The engines are idle afterwards."""
        start = time.perf_counter()
        through = min(version + self.k, self._last)
        with self._cond:
            self._sync_waiting = True
            self._cond.notify_all()
            self._cond.wait_for(
                lambda: (
                    self._done_through >= through
                    or self._paused
                    or any(isinstance(v, BaseException) for v, _ in self._done.values())
                )
            )
        return time.perf_counter() - start

    def synced(self, version: int) -> None:
        """The engines serve policy `version` now: the steps it unlocks may generate, and a
        paused generation goes on."""
        with self._cond:
            self._synced = version
            self._sync_waiting = False
            self._cond.notify_all()

    def pause_point(self) -> None:
        """Called by the generation between two chunks (partial rollouts): when a sync waits,
        let it run and return once it is done."""
        with self._cond:
            if not self._sync_waiting:
                return
            self._paused = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._closed or not self._sync_waiting)
            self._paused = False

    def close(self) -> None:
        """Stop generating ahead; a generation in progress finishes first, and what was
        generated for steps not taken is dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
