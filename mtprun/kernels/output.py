"""What the fused head loss returns (the torch and Triton paths alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HeadLossOutput:
    """loss:     0-d tensor, the weighted sum of all terms; differentiable w.r.t. hidden,
                 weight and mtp_hidden.
    metrics:  0-d detached tensors: "entropy" and one entry per term kind, plus sub-metrics
              such as "grpo/clip_frac" or "mtp/1/top1_agree".
    logprobs: [N] detached log-prob of each target, 0 where masked.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    logprobs: torch.Tensor
