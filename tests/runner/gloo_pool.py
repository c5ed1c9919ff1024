"""Spawned gloo workers kept for the parallel-layout tests of a test process (`gloo_pool`).

Spawning a trainer process costs seconds of imports (torch, megatron-core, the trainer),
more than the tiny models take to train, so the layout tests share one set of workers: each
`GlooPool.run` has ranks 0..world-1 join a fresh process group with `init_parallel` (the
trainer's own set-up), call one function, and tear it down with `destroy_parallel`, as a
trainer process does; the next layout starts from Megatron's state destroyed. A rank that
raises, dies or goes silent fails the call with its traceback and the workers are replaced.
Workers left idle for three minutes are stopped (they hold the imports' memory), and started again
by the next call.
"""

from __future__ import annotations

import io
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from mtprun.runner.net import free_port
from mtprun.spec.parallel import ParallelSection

_RESULT_TIMEOUT_S = 600.0
_IDLE_S = 180.0


def _serve(rank: int, jobs: Any, results: Any) -> None:
    """Worker `rank`: run jobs until told to stop (None), answering (rank, ok, payload)."""
    # One thread a worker: the layouts' processes share the machine's cores.
    torch.set_num_threads(1)
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel

    while (job := jobs.get()) is not None:
        fn, layout, port, args = job
        try:
            parallel = ParallelSection(**layout)
            init_parallel(parallel, rank, parallel.world_size, "127.0.0.1", port)
            value = fn(rank, layout, *args)
            destroy_parallel()
            buffer = io.BytesIO()
            torch.save(value, buffer)
            results.put((rank, True, buffer.getvalue()))
        except BaseException:  # reported; the parent replaces the workers
            results.put((rank, False, traceback.format_exc()))
            return


class GlooPool:
    """Worker processes, started on demand and kept between calls."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._workers: list[tuple[Any, Any]] = []  # (process, its job queue)
        self._results: Any = None
        self._lock = threading.Lock()
        self._calls = 0  # an idle timer stops the workers only if no call came after it

    def run(self, layout: dict[str, int], fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(rank, layout, *args)` on every rank of `layout` (a recipe's parallel section as
        a dict), each in its initialised process group; what each rank returned, by rank.
        `fn` and `args` must pickle (a module-level function)."""
        with self._lock:
            self._calls += 1
            try:
                return self._run(layout, fn, args)
            finally:
                timer = threading.Timer(_IDLE_S, self._close_if_idle, args=(self._calls,))
                timer.daemon = True
                timer.start()

    def _run(self, layout: dict[str, int], fn: Callable[..., Any], args: tuple) -> list[Any]:
        world = ParallelSection(**layout).world_size
        self._grow(world)
        port = free_port()
        for _, jobs in self._workers[:world]:
            jobs.put((fn, layout, port, args))
        got: dict[int, Any] = {}
        deadline = time.monotonic() + _RESULT_TIMEOUT_S
        while len(got) < world:
            try:
                rank, ok, payload = self._results.get(timeout=2.0)
            except queue.Empty:
                dead = [r for r, (p, _) in enumerate(self._workers[:world]) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} died" if dead else f"no answer in {_RESULT_TIMEOUT_S} s"
                    raise RuntimeError(f"layout {layout}: {why}") from None
                continue
            if not ok:
                self.close()
                raise RuntimeError(f"layout {layout}, rank {rank} raised:\n{payload}")
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        return [got[rank] for rank in range(world)]

    def _grow(self, size: int) -> None:
        if any(not process.is_alive() for process, _ in self._workers):
            self.close()
        if self._results is None:
            self._results = self._ctx.Queue()
        while len(self._workers) < size:
            jobs = self._ctx.Queue()
            process = self._ctx.Process(
                target=_serve, args=(len(self._workers), jobs, self._results), daemon=True
            )
            process.start()
            self._workers.append((process, jobs))

    def _close_if_idle(self, calls: int) -> None:
        with self._lock:
            if calls == self._calls:
                self.close()

    def close(self) -> None:
        """Stop the workers (killing any that do not stop); the next call starts new ones."""
        for process, jobs in self._workers:
            if process.is_alive():
                jobs.put(None)
        for process, _ in self._workers:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self._workers, self._results = [], None


_pool = GlooPool()


def gloo_pool() -> GlooPool:
    """The test process's workers, shared by every module that runs layouts."""
    return _pool
