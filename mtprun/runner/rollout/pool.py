"""The rollout engines as one pool: prompts sharded over engines, a dead engine's share retried.

Each engine is a Ray actor with `max_restarts`; when its process dies mid-call (engine crash,
OOM kill) Ray starts a fresh process from the same arguments, i.e. the stage's initial
weights. Whatever call noticed the death (generate, weight sync, counters), the pool waits for
the new process, syncs the current policy weights into it, and sends only that engine's call
again; results are stored per shard, so no prompt is lost or counted twice. (A restarted
engine's speculative-decoding counters start from zero.)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from mtprun.runner.actors import stop_actors, torch_threads
from mtprun.runner.rollout.engine import spec_decode_metrics
from mtprun.runner.rollout.worker import RolloutWorker

log = logging.getLogger("mtprun")

_RESTART_TIMEOUT_S = 600  # a restarted engine loads its model again
MAX_RESTARTS = 3  # per engine and attempt; also the retries of one engine's prompts per step


class RolloutPool:
    def __init__(self, actors: list[Any], max_retries: int) -> None:
        self.actors = actors
        self.max_retries = max_retries
        self.restarts = 0
        self._weights: Any = None  # ObjectRef of the newest policy weights, for restarted engines
        # Per engine: its pid and its counters at the previous spec_decode_step.
        self._spec_seen: dict[int, tuple[int, dict[str, float]]] = {}
        self.pids = ray.get([a.pid.remote() for a in actors])

    @classmethod
    def start(cls, recipe: Any, policy_dir: Path, work_dir: Path) -> RolloutPool:
        """`rollout.num_engines` engines on `policy_dir`, each with its own work folder."""
        res, count = recipe.resources, recipe.rollout.num_engines
        remote = ray.remote(RolloutWorker).options(
            num_cpus=res.cpus_per_actor, num_gpus=res.gpus_per_actor, max_restarts=MAX_RESTARTS
        )
        threads = torch_threads(res, count)
        actors = [
            remote.remote(
                str(policy_dir),
                recipe.rollout,
                recipe.seed + i,
                str(work_dir / f"engine{i}"),
                threads,
            )
            for i in range(count)
        ]
        return cls(actors, max_retries=MAX_RESTARTS)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> list[list[Any]]:
        """Samples for each prompt, in prompt order (see RolloutEngine.generate)."""
        calls = {
            i: (prompts[lo:hi], n, max_tokens, stop_token_ids, temperature, top_p)
            for i, (lo, hi) in enumerate(_split(len(prompts), len(self.actors)))
            if hi > lo
        }
        shards = self._on_engines("generate", calls)
        return [samples for i in sorted(shards) for samples in shards[i]]

    def _on_engines(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """`method(*args)` on engine i for each i of `calls`, concurrently; an engine that
        dies meanwhile is restarted and its call sent again."""
        refs = {i: getattr(self.actors[i], method).remote(*args) for i, args in calls.items()}
        return {i: self._result(i, ref, method, calls[i]) for i, ref in refs.items()}

    def _result(self, i: int, ref: Any, method: str, args: tuple) -> Any:
        for attempt in range(1, self.max_retries + 2):
            try:
                return ray.get(ref)
            # A killed engine surfaces as either, depending on when Ray notices: ActorDied
            # (a RayActorError) or "temporarily unavailable" while its restart is under way.
            except (RayActorError, ActorUnavailableError) as err:
                if attempt > self.max_retries:
                    raise RuntimeError(
                        f"rollout engine {i} died {attempt} times in one step; giving up "
                        f"(last error: {type(err).__name__}: {err})"
                    ) from err
                log.warning(
                    "rollout engine %d (pid %s) died during %s (%s); waiting for Ray to "
                    "restart it, then calling it again (retry %d of %d)",
                    i,
                    self.pids[i],
                    method,
                    type(err).__name__,
                    attempt,
                    self.max_retries,
                )
                synced_s = self._recover(i)
                if method == "update_weights" and synced_s is not None:
                    return synced_s  # the recovery's weight sync was this very call
                ref = getattr(self.actors[i], method).remote(*args)
        raise AssertionError("unreachable")

    def _recover(self, i: int) -> float | None:
        """Wait for Ray to restart engine i and sync the newest weights into it; returns the
        sync's seconds (None before the first sync: the restart loaded the stage's weights)."""
        self.pids[i] = self._wait_until_up(i)
        self.restarts += 1
        synced_s = None
        if self._weights is not None:
            synced_s = ray.get(self.actors[i].update_weights.remote(self._weights))
        log.warning("rollout engine %d restarted (new pid %s), weights re-synced", i, self.pids[i])
        return synced_s

    def _wait_until_up(self, i: int) -> int:
        """The pid of engine i once Ray has restarted it (its engine loaded)."""
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while True:
            try:
                return ray.get(self.actors[i].pid.remote())
            except ActorUnavailableError:  # still restarting; ActorDiedError: out of restarts
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def update_weights(self, weights_ref: Any) -> float:
        """Sync the policy into every engine; returns the slowest engine's seconds."""
        self._weights = weights_ref
        calls = {i: (weights_ref,) for i in range(len(self.actors))}
        return max(self._on_engines("update_weights", calls).values())

    def spec_decode_step(self) -> dict[str, float]:
        """Speculative-decoding acceptance since the previous call, summed over engines. The
        engines count up; one restarted since the previous call counts from zero again."""
        calls = {i: () for i in range(len(self.actors))}
        delta: dict[str, float] = {}
        for i, now in self._on_engines("spec_decode_counters", calls).items():
            seen_pid, seen = self._spec_seen.get(i, (self.pids[i], {}))
            if seen_pid != self.pids[i]:  # restarted since: its counters began again at 0
                seen = {}
            for key, value in now.items():
                delta[key] = delta.get(key, 0.0) + value - seen.get(key, 0.0)
            self._spec_seen[i] = (self.pids[i], now)
        return spec_decode_metrics(delta)

    def shutdown(self) -> None:
        stop_actors(self.actors)


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges, sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds
