"""A reward worker process's entry point (spawned by rewards.RewardPool).

A module of its own, importing only the rewards it runs: a spawned process imports the module
of its target function, and the pool's module pulls in torch and the rollout engine's
scorers (~4 CPU-seconds per worker at every run's start, for nothing it uses)."""

from __future__ import annotations

import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

from mtprun.data.rewards import RewardValueError, call_reward, load_reward

READY, BROKEN, RESULT = "ready", "broken", "result"


def worker_main(conn: Connection, references: list[str]) -> None:
    """Load the rewards, then score episodes until the pipe closes: READY (or BROKEN with the
    traceback) once, then one (RESULT, (value, error)) per (which reward, episode) received."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    try:
        fns = [load_reward(reference) for reference in references]
    except BaseException:
        conn.send((BROKEN, traceback.format_exc()))
        return
    conn.send((READY, None))
    while True:
        try:
            which, episode = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result: tuple[Any, Any] = (call_reward(fns[which], episode), None)
        except RewardValueError as err:
            result = (None, f"{references[which]} {err}")
        except BaseException:
            result = (None, traceback.format_exc())
        conn.send((RESULT, result))
