"""How the runner scores with a reward: the plain descriptions a reward source's factory
(`scoring(spec)`) returns and `mtprun.runner.rollout.rewards.EpisodeScorer` runs.

There are three ways, each a strategy of the runner's, not a kind of reward:

    InWorkers   a reward function (a built-in's name or a reference) called in the reward
                worker processes, under task.reward_timeout_s (a hanging one is killed)
    InThreads   a synchronous `score(episode, deadline) -> components` object, built once by
                `make()`, called from `concurrency` threads
    OnActor     a model served on a vLLM engine in a Ray actor beside the rollout engines (one
                per model folder and kind, shared by the rewards that serve it), scoring a
                step's episodes in one batched call
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InWorkers:
    """A reward function run by the reward workers (`mtprun.data.rewards.load_reward`)."""

    reference: str


@dataclass(frozen=True)
class InThreads:
    """A judge object (`make()` builds it) whose `score(episode, deadline)` returns reward
    components, called from a pool of `concurrency` threads; errors it raises (`errors`) are
    the episode's, any other is a traceback."""

    make: Callable[[], Any]
    concurrency: int
    label: str


@dataclass(frozen=True)
class OnActor:
    """A reward model served by the run (`spec`: its config, the runner's ServedScorer's)."""

    spec: Any
    label: str


Scoring = InWorkers | InThreads | OnActor
