"""One reward call's outcome, shared by the reward workers, the judges and the served reward
models (mtprun.runner.rollout.rewards, .scorers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RewardOutcome:
    """One call's components (`total` included), or why it failed."""

    components: dict[str, float] | None
    error: str | None = None
