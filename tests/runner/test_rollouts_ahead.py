"""The asynchronous-rollout schedule: step s is sampled by policy version s - 1 - k exactly,
never older; generation runs ahead of training; no weight sync lands inside a generation; an
episode older than k is refused before it trains."""

from __future__ import annotations

import threading

import pytest

from mtprun.runner.run.rollouts_ahead import RolloutsAhead
from mtprun.runner.run.steps import staleness_metrics


class _Loop:
    """The driver's side of the schedule with a generation that records what it saw."""

    def __init__(self, k: int, first: int, last: int, fail_at: int | None = None) -> None:
        self.served = first - 1  # the version the engines hold
        self.events: list[str] = []
        self.lock = threading.Lock()
        self.fail_at = fail_at
        self.rollouts = RolloutsAhead(self.generate, k, first, last)

    def generate(self, step: int) -> int:
        with self.lock:
            self.events.append(f"gen{step}@{self.served}")
        if step == self.fail_at:
            raise ValueError(f"engine failure at step {step}")
        with self.lock:
            self.events.append(f"done{step}")
        return self.served

    def step(self, step: int) -> int:
        version = self.rollouts.take(step).value
        self.rollouts.before_sync(step)
        with self.lock:
            self.events.append(f"sync{step}")
            self.served = step
        self.rollouts.synced(step)
        return version


@pytest.mark.parametrize("k", [0, 1, 3])
def test_step_s_is_sampled_by_version_s_minus_1_minus_k(k):
    loop = _Loop(k, first=5, last=14)  # a loop resumed after step 4
    versions = {s: loop.step(s) for s in range(5, 15)}
    loop.rollouts.close()
    assert versions == {s: max(4, s - 1 - k) for s in range(5, 15)}
    staleness = [(s - 1) - v for s, v in versions.items()]
    assert max(staleness) == k and staleness[-1] == k


def test_generation_runs_ahead_and_no_sync_lands_inside_one():
    loop = _Loop(k=1, first=1, last=4)
    for s in range(1, 5):
        loop.step(s)
    loop.rollouts.close()
    # Step 2 generates before step 1's weights arrive (the trainer trains meanwhile); every
    # sync comes between two whole generations.
    assert loop.events == [
        "gen1@0",
        "done1",
        "gen2@0",
        "done2",
        "sync1",
        "gen3@1",
        "done3",
        "sync2",
        "gen4@2",
        "done4",
        "sync3",
        "sync4",
    ]


def test_synchronous_mode_alternates_generation_and_sync():
    loop = _Loop(k=0, first=1, last=3)
    for s in range(1, 4):
        loop.step(s)
    loop.rollouts.close()
    assert loop.events == [
        *("gen1@0", "done1", "sync1"),
        *("gen2@1", "done2", "sync2"),
        *("gen3@2", "done3", "sync3"),
    ]


def test_a_generation_error_reaches_the_step_that_needs_it():
    loop = _Loop(k=2, first=1, last=6, fail_at=2)
    assert loop.step(1) == 0  # generated before the failure; its sync does not wait forever
    with pytest.raises(ValueError, match="engine failure at step 2"):
        loop.rollouts.take(2)
    loop.rollouts.close()


def test_close_drops_what_was_generated_ahead():
    loop = _Loop(k=2, first=1, last=10)
    loop.step(1)
    loop.rollouts.close()
    assert not any(e.startswith("gen5") for e in loop.events)  # bounded by k after step 1


def test_staleness_is_logged_and_an_episode_older_than_k_refused():
    assert staleness_metrics([7, 8, 8, 6], trainer_version=8, k=2) == {
        "rollout/staleness": 0.75,
        "rollout/staleness_max": 2.0,
    }
    with pytest.raises(RuntimeError, match=r"sampled by policy version 5 .* 3 steps stale"):
        staleness_metrics([7, 5, 8], trainer_version=8, k=2)
