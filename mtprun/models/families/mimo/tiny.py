"""A tiny MiMo model's MTP layers (`mtprun.models.tiny` draws the trunk)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer


def mtp_tensors(config: PretrainedConfig, count: int) -> dict[str, torch.Tensor]:
    """MiMo MTP layer tensors, initialised like the trunk (normal(0, initializer_range))."""
    hidden, std = config.hidden_size, config.initializer_range
    tensors = {}
    for i in range(count):
        prefix = f"model.mtp_layers.{i}."
        layer = Qwen2DecoderLayer(config, layer_idx=0)  # shapes only; values are redrawn
        params = {n: p.detach() for n, p in layer.state_dict().items()}
        params["token_layernorm.weight"] = torch.empty(hidden)
        params["hidden_layernorm.weight"] = torch.empty(hidden)
        params["final_layernorm.weight"] = torch.empty(hidden)
        params["input_proj.weight"] = torch.empty(hidden, 2 * hidden)
        for name, t in params.items():
            if "norm" in name:
                t = torch.ones_like(t)
            elif name.endswith(".bias"):
                t = torch.zeros_like(t)
            else:
                t = torch.randn_like(t) * std
            tensors[prefix + name] = t.contiguous()
    return tensors
