"""Group-normalised advantages against a float64 reference, on fresh random rewards."""

import pytest
import torch

from mtprun.runner.rollout.advantages import group_advantages


def _reference(rewards: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for i, group in enumerate(rewards.to(torch.float64)):
        mean = sum(group.tolist()) / len(group)
        std = (sum((r - mean) ** 2 for r in group.tolist()) / len(group)) ** 0.5
        if std > 0:
            out[i] = (group - mean) / (std + 1e-6)
    return out


@pytest.mark.parametrize("shape", [(1, 2), (5, 8), (3, 7)])
def test_matches_reference(shape):
    rewards = torch.rand(shape)
    rewards[0, :] = rewards[0, 0]  # one group without signal
    got = group_advantages(rewards)
    torch.testing.assert_close(got.double(), _reference(rewards), rtol=1e-5, atol=1e-6)
    assert (got[0] == 0).all()
    torch.testing.assert_close(got.sum(dim=1), torch.zeros(shape[0]), atol=1e-5, rtol=0)


def test_binary_rewards_have_unit_scale():
    rewards = torch.randint(0, 2, (16, 8)).float()
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0  # every group has both outcomes
    got = group_advantages(rewards)
    torch.testing.assert_close(got.std(dim=1, unbiased=False), torch.ones(16), atol=1e-4, rtol=0)


def test_without_std_scaling_only_centres():
    rewards = torch.randn(4, 6)
    got = group_advantages(rewards, scale_by_std=False)
    torch.testing.assert_close(got, rewards - rewards.mean(dim=1, keepdim=True))


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (torch.rand(8), "at least 2 samples per prompt"),
        (torch.rand(4, 1), "at least 2 samples per prompt"),
        (torch.tensor([[0.0, float("nan")]]), "NaN or inf"),
    ],
)
def test_bad_rewards_are_reported(rewards, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards)
