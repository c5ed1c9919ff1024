"""The built-in rewards, registered by name (a recipe's `task.reward`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., Any]
"""A reward function: takes any of REWARD_ARGUMENTS by name (see call.py), returns a float or
a mapping of named float components with a `total`."""

REWARDS: dict[str, RewardFn] = {}


def register_reward(*names: str) -> Callable[[RewardFn], RewardFn]:
    """Register a built-in reward under `names` (the first is its own, the others aliases)."""

    def register(fn: RewardFn) -> RewardFn:
        for name in names:
            if name in REWARDS:
                raise ValueError(f"reward {name!r} is registered twice")
            REWARDS[name] = fn
        return fn

    return register
