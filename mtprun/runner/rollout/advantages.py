"""Group-normalised advantages (GRPO): each sample is scored against its prompt's group."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards: [prompts, samples_per_prompt] -> advantages of the same shape.

    A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps), std unbiased=False so that a group of
    two identical rewards gives std 0. A group whose rewards are all equal carries no signal
    and gets advantage 0 everywhere (not 0/eps noise).
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be [prompts, samples_per_prompt] with at least 2 samples per prompt "
            f"(GRPO compares samples of one prompt), got shape {tuple(rewards.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; check the task's reward function")
    rewards = rewards.to(torch.float64)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred.to(torch.float32)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    advantages = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return advantages.to(torch.float32)
