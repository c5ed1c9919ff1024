"""A built-in reward's name or a Python function of the user's (`package.module:function`,
`path/to/file.py:function`): `task.reward: <string>`, `task.rewards: [{reward: ..., ...}]`.

Fulfils mtprun.spec.sources.RewardSource: a string names it (no CONFIG); preflight imports it
as the reward workers will and checks its signature; it scores in the reward worker processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from mtprun.sources.scoring import InWorkers
from mtprun.spec.reward_fields import Weighted

if TYPE_CHECKING:
    from mtprun.spec.sources import Problems

NAME = "function"
CONFIG = None


class FunctionRewardTerm(Weighted):
    """A rule reward of task.rewards: a built-in or a Python function, weighted."""

    type: Literal["function"] = Field("function", description="A built-in or a Python function.")
    reward: str = Field(
        ...,
        description="A built-in reward (exact_answer, math, reasoning_gym, ...) or "
        "`package.module:function` / `path/to/file.py:function`.",
    )

    @property
    def label(self) -> str:
        return self.name or label(self.reward)

    @property
    def spec(self) -> str:
        return self.reward

    @property
    def spec_path(self) -> tuple[str, ...]:
        """Where `spec` sits in the entry (a check's findings are located below it)."""
        return ("reward",)


TERM = FunctionRewardTerm


def infer(value: Any) -> bool:
    if isinstance(value, dict):
        return "reward" in value and "kind" not in value and "url" not in value
    return isinstance(value, str)


def label(spec: str) -> str:
    return spec.rpartition(":")[2]


def describe(spec: str) -> str:
    return spec


def actors(spec: str) -> int:
    return 0


def check(spec: str) -> Problems:
    # Imports the reward (user code) as the reward workers will: its errors are the recipe's.
    from mtprun.data.rewards import reward_problem

    problem = reward_problem(spec)
    if problem is not None:
        yield (), problem


def scoring(spec: str) -> InWorkers:
    return InWorkers(spec)
