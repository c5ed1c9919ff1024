"""DAPO dynamic sampling's bookkeeping: which groups carry a signal, and that a selection keeps
every episode with its own group's rewards (the advantages are computed from them)."""

from __future__ import annotations

import torch

from mtprun.runner.rollout.advantages import group_advantages
from mtprun.runner.rollout.episodes import Episodes
from mtprun.runner.rollout.rewards import RewardOutcome


def _episodes(rewards: list[list[float]], tag: str, errors: int = 0) -> Episodes:
    n = len(rewards[0])
    names = [f"{tag}{g}.{j}" for g in range(len(rewards)) for j in range(n)]
    flat = [r for group in rewards for r in group]
    outcomes = [RewardOutcome({"total": r, "index": k}) for k, r in enumerate(flat)]
    return Episodes(
        prompts=[f"{tag}{g}" for g in range(len(rewards))],
        conversations=names,
        trajectories=names,
        rewards=torch.tensor(rewards),
        sampled_tokens=list(range(len(names))),
        truncated=[False] * len(names),
        tool_turns=[0] * len(names),
        versions=list(range(len(names))),
        reward_outcomes=outcomes,
        reward_errors=errors,
    )


def test_groups_of_equal_rewards_are_not_informative():
    episodes = _episodes([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25]], "a")
    assert episodes.informative_groups() == [1, 3]
    uniform = episodes.groups([0, 2])
    assert (group_advantages(uniform.rewards) == 0).all()  # what dropping them loses


def test_selected_and_joined_groups_keep_their_episodes_and_rewards():
    first = _episodes([[1, 1], [0, 1], [1, 0]], "a", errors=2)
    second = _episodes([[0, 0], [1, 0]], "b", errors=1)
    kept = first.groups(first.informative_groups()) + second.groups(second.informative_groups())
    assert kept.prompts == ["a1", "a2", "b1"]
    assert kept.trajectories == ["a1.0", "a1.1", "a2.0", "a2.1", "b1.0", "b1.1"]
    assert kept.sampled_tokens == [2, 3, 4, 5, 2, 3]
    assert kept.versions == [2, 3, 4, 5, 2, 3]
    assert kept.rewards.tolist() == [[0, 1], [1, 0], [1, 0]]
    assert kept.num_groups == 3
    # Reward components follow their episodes; errors count every episode sampled.
    assert [o.components["index"] for o in kept.reward_outcomes] == [2, 3, 4, 5, 2, 3]
    assert kept.reward_metrics() == {"reward/index": 19 / 6, "reward/errors": 3.0}
