"""A tiny Qwen3.5 model's MTP layer (`mtprun.models.tiny` draws the trunk)."""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

from mtprun.models.qwen3_5_shape import FULL_ATTENTION


def mtp_tensors(config: PretrainedConfig, count: int) -> dict[str, torch.Tensor]:
    """Qwen3.5 MTP tensors under `mtp.` (vLLM's `Qwen3_5MTP` layout): `fc` [H, 2H] and the
    gated attention layers `layers.{i}.` (normal(0, initializer_range)), the zero-centred norms
    `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm` and the layers' own at 0."""
    hidden, std = config.hidden_size, config.initializer_range
    layer_config = copy.deepcopy(config)
    layer_config.layer_types = [FULL_ATTENTION] * config.num_hidden_layers
    tensors = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden) * std}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    for i in range(count):
        layer = Qwen3_5DecoderLayer(layer_config, layer_idx=0)  # shapes only; values redrawn
        for name, t in layer.state_dict().items():
            drawn = torch.zeros_like(t) if "norm" in name else torch.randn_like(t) * std
            tensors[f"mtp.layers.{i}.{name}"] = drawn.contiguous()
    return tensors
