"""The rollout engines as one pool: prompts sharded over engines, a dead engine's share retried.

Each engine is a Ray actor with `max_restarts`; when its process dies mid-call (engine crash,
OOM kill) Ray starts a fresh process from the same arguments, i.e. the stage's initial
weights. Whatever call noticed the death (generate, weight sync, counters), the pool waits for
the new process, brings it to the policy (`resync`: the weights of the last object-store sync,
or what the run's weight sync installs, see run/weight_sync.py), and sends only that engine's
call again; results are stored per shard, so no prompt is lost or counted twice. (A restarted
engine's speculative-decoding counters start from zero.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from mtprun.runner.actors import stop_actors, torch_threads
from mtprun.runner.placement import Placement
from mtprun.runner.rollout.engine import DEFAULT_SAMPLING, Sampling, spec_decode_metrics
from mtprun.runner.rollout.partial import PartialRollouts
from mtprun.runner.rollout.worker import RolloutWorker

log = logging.getLogger("mtprun")

_RESTART_TIMEOUT_S = 600  # a restarted engine loads its model again
MAX_RESTARTS = 3  # per engine and attempt; also the retries of one engine's prompts per step


class RolloutPool:
    def __init__(
        self, actors: list[Any], max_retries: int, partial: PartialRollouts | None = None
    ) -> None:
        self.actors = actors
        self.max_retries = max_retries
        self.partial = partial  # rollout.partial: generation in chunks
        self.restarts = 0
        self._weights: tuple[Any, int] | None = None  # the last object-store sync: (ref, version)
        # Brings restarted engine i to the policy; returns the seconds of its weight sync, or
        # None when it has nothing newer than what the engine started from.
        self.resync: Callable[[int], float | None] = self._resync_from_object_store
        # Per engine: its pid and its counters at the previous spec_decode_step.
        self._spec_seen: dict[int, tuple[int, dict[str, float]]] = {}
        self.pids: list[int] = []  # set by ready()

    @classmethod
    def launch(
        cls,
        recipe: Any,
        policy_dir: Path,
        work_dir: Path,
        placement: Placement | None = None,
        version: int = 0,
    ) -> RolloutPool:
        """`rollout.num_engines` engines on `policy_dir` (policy `version`: the global step
        that made it), each with its own work folder, placed by `placement` (the recipe's by
        default), created and left loading in their processes: the caller goes on (a trainer
        may load meanwhile) and calls `ready` before anything else."""
        placement = placement or Placement(recipe)
        count = recipe.rollout.num_engines
        remote = ray.remote(RolloutWorker)
        threads = torch_threads(recipe, count)
        actors = [
            remote.options(**placement.engine_options(i), max_restarts=MAX_RESTARTS).remote(
                str(policy_dir),
                recipe.rollout,
                recipe.seed + i,
                str(work_dir / f"engine{i}"),
                threads,
                version,
                recipe.trainer.router_replay,  # return each sample's expert routing
                recipe.model.lora,  # serve the base with adapters, synced alone
                placement.colocate,  # sleeps while the trainer beside it trains
                recipe.model.dtype,  # samples in the trainer's dtype
            )
            for i in range(count)
        ]
        rollout = recipe.rollout
        partial = None
        if rollout.partial:
            partial = PartialRollouts(rollout.partial_chunk_tokens, rollout.max_tokens)
        return cls(actors, max_retries=MAX_RESTARTS, partial=partial)

    def ready(self) -> RolloutPool:
        """Waits until every engine is up (its pid in `pids`); one that failed to start stops
        them all and raises RuntimeError with its error."""
        try:
            self.pids = ray.get([a.pid.remote() for a in self.actors])
        except RayActorError as err:
            stop_actors(self.actors)
            raise RuntimeError(f"a rollout engine failed to start: {_start_error(err)}") from err
        return self

    def generate(
        self, prompts: list[list[int]], n: int, sampling: Sampling = DEFAULT_SAMPLING
    ) -> list[list[Any]]:
        """Samples for each prompt, in prompt order (see RolloutEngine.generate); with partial
        rollouts in chunks, a weight update allowed between them (rollout/partial.py)."""
        if self.partial is not None:
            return self.partial.generate(self._generate, prompts, n, sampling)
        return self._generate(prompts, n, sampling)

    def _generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Any]]:
        calls = {
            i: (prompts[lo:hi], n, sampling)
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

    def revive(self) -> bool:
        """Ask every engine whether it lives; restart (and resync) the dead ones. True when
        one was restarted."""
        restarts = self.restarts
        pids = self._on_engines("pid", {i: () for i in range(len(self.actors))})
        for i, pid in pids.items():
            # Ray restarted it before any call of ours failed on it (it died while a weight-
            # transfer formation waited for it): a new process on the stage's initial weights.
            if pid != self.pids[i]:
                log.warning("rollout engine %d (pid %s) died; Ray restarted it", i, self.pids[i])
                self._recover(i)
        return self.restarts > restarts

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
        """Wait for Ray to restart engine i and bring it to the policy; returns the sync's
        seconds (None when the restart's own weights, the stage's first, are the policy)."""
        self.pids[i] = self._wait_until_up(i)
        self.restarts += 1
        synced_s = self.resync(i)
        log.warning("rollout engine %d restarted (new pid %s), weights re-synced", i, self.pids[i])
        return synced_s

    def _resync_from_object_store(self, i: int) -> float | None:
        if self._weights is None:
            return None
        return ray.get(self.actors[i].update_weights.remote(*self._weights))

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

    def update_weights(self, weights_ref: Any, version: int) -> float:
        """Sync policy `version` into every engine through Ray's object store; returns the
        slowest engine's seconds."""
        self._weights = (weights_ref, version)
        calls = {i: (weights_ref, version) for i in range(len(self.actors))}
        return max(self._on_engines("update_weights", calls).values())

    def update_weights_in_parts(
        self, parts: Iterable[list[Any]], version: int, load: str = "load_ipc_part"
    ) -> float:
        """Sync policy `version` into every engine part by part (`stream_update`); an engine
        that died meanwhile is restarted and re-synced once the stream ended. Returns the
        slowest engine's seconds."""
        seconds, dead = self.stream_update(parts, version, range(len(self.actors)), load)
        for i in dead:
            log.warning("rollout engine %d (pid %s) died during a weight sync", i, self.pids[i])
            seconds[i] = self._recover(i) or 0.0
        return max(seconds.values())

    def stream_update(
        self,
        parts: Iterable[list[Any]],
        version: int,
        engines: Iterable[int],
        load: str = "load_ipc_part",
    ) -> tuple[dict[int, float], list[int]]:
        """Policy `version` into `engines`: `parts` yields each part as one item per engine
        (colocated: trainer rank i's CUDA IPC handles for engine i), which engine i loads
        (`load`: `load_ipc_part`, or `load_part` for tensors) before the next part is asked
        for. The whole stream is taken even when an engine dies (the trainer's ranks gather
        every part together): the engine misses the rest. Returns each finished engine's
        seconds and the engines that died; a failing `parts` aborts the engines' updates."""
        self._weights = None  # an older object-store copy must never reach a restarted engine
        engines = list(engines)
        live = list(self._each("begin_update", {i: (version,) for i in engines}))
        try:
            for part in parts:
                live = list(self._each(load, {i: (part[i],) for i in live}))
        except BaseException:
            if isinstance(parts, Generator):
                parts.close()  # now, not when the traceback goes: the trainer's ranks end it
            self._each("abort_update", {i: () for i in live})
            raise
        seconds = self._each("finish_update", {i: () for i in live})
        return seconds, [i for i in engines if i not in seconds]

    def _each(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """`method(*args)` on engine i for each i of `calls`, concurrently; the answers of
        those that did not die (no retry: a part of a stream is not sent twice)."""
        refs = {i: getattr(self.actors[i], method).remote(*args) for i, args in calls.items()}
        answers = {}
        for i, ref in refs.items():
            try:
                answers[i] = ray.get(ref)
            except (RayActorError, ActorUnavailableError):
                continue
        return answers

    def sleep(self) -> float:
        """Colocated: every engine releases its GPU memory for the trainer's step; returns
        the slowest engine's seconds."""
        calls = {i: () for i in range(len(self.actors))}
        return max(self._on_engines("sleep", calls).values())

    def wake_up(self) -> float:
        """Colocated: every engine wakes what still sleeps (its KV cache after a CUDA IPC
        sync); returns the slowest engine's seconds."""
        calls = {i: () for i in range(len(self.actors))}
        return max(self._on_engines("wake_up", calls).values())

    def join_transfer(self, address: tuple[str, int], generation: int) -> list[Any]:
        """Every engine joins the transfer group's `generation` as member 1 + i (member 0,
        trainer rank 0, joins beside them); ObjectRefs, ready once the group formed."""
        world = len(self.actors) + 1
        return [
            actor.join_transfer.remote(*address, generation, 1 + i, world)
            for i, actor in enumerate(self.actors)
        ]

    def receive_weights(self, version: int) -> list[Any]:
        """Every engine receives the broadcast trainer rank 0 sends next, as policy `version`;
        ObjectRefs of (broadcast seconds, reload seconds). Not retried: a broadcast needs its
        sender, so a death here is for the caller to handle (see run/weight_sync.py)."""
        self._weights = None  # an older object-store copy must never reach a restarted engine
        return [actor.receive_weights.remote(version) for actor in self.actors]

    def generation_step(self) -> dict[str, float]:
        """Since the previous call: the slowest engine's seconds inside vLLM's generate and
        the engines' sampled tokens per second over them (what the rollout's seconds spent
        outside vLLM are measured against)."""
        taken = self._on_engines("take_generated", {i: () for i in range(len(self.actors))})
        seconds = max((s for s, _ in taken.values()), default=0.0)
        tokens = sum(t for _, t in taken.values())
        metrics = {"time/engine_generate_s": seconds}
        if seconds > 0:
            metrics["rollout/engine_tokens_per_s"] = tokens / seconds
        return metrics

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


def _start_error(err: Exception) -> str:
    """An engine's start failure in words, with what to change where it is a known one."""
    text = str(getattr(err, "cause", None) or err)
    if "Free memory on device" in text or "out of memory" in text.lower():
        return (
            f"{text.strip().splitlines()[-1]}: lower rollout.gpu_memory_utilization, or give "
            "the engines GPUs of their own (resources.placement: split)"
        )
    if "CUDA" in text or "NVIDIA" in text:
        return f"{text.strip().splitlines()[-1]} (is the GPU driver working? nvidia-smi)"
    return text.strip().splitlines()[-1] if text.strip() else type(err).__name__
