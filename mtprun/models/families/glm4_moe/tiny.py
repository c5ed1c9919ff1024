"""A tiny GLM-4.5 model's MTP layers (`mtprun.models.tiny` draws the trunk, and their decoder
layers as extra decoder layers: `Family.mtp_in_decoder_layers`)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig


def mtp_tensors(config: PretrainedConfig, count: int) -> dict[str, torch.Tensor]:
    """The own tensors of DeepSeek-V3-style MTP layers: `enorm`, `hnorm`, `shared_head.norm`
    (ones) and `eh_proj` (normal(0, initializer_range)) of each, under
    `model.layers.{num_hidden_layers + i}.`."""
    hidden, std = config.hidden_size, config.initializer_range
    tensors = {}
    for i in range(count):
        prefix = f"model.layers.{config.num_hidden_layers + i}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(hidden)
        tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * std
    return tensors
