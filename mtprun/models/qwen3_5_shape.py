"""Qwen3.5's hybrid layers as a config.json declares them (no torch: `mtprun validate` reads it).

Qwen3.5 interleaves two token mixers, in the order `layer_types` gives (transformers'
default when a config leaves it out: every `full_attention_interval`-th layer, 4 by default,
is full attention):

- "linear_attention": Gated DeltaNet. Per token, in projections give q, k (`key_heads` heads
  of `key_dim`), v (`value_heads` heads of `value_dim`) through a short causal depthwise
  convolution (`conv_kernel` taps, SiLU), an output gate z (value width), beta = sigmoid(b)
  and the log-decay g = -exp(A_log) softplus(a + dt_bias) per value head. Value head h reads
  key head h // (value_heads / key_heads). The gated delta rule over l2-normed q, k, then
  RMSNorm(o) * silu(z) per value head, then out_proj.
- "full_attention": gated attention. q_proj gives each head's query and a sigmoid output
  gate, q/k RMSNorms per head, RoPE on a quarter of each head.

Every RMSNorm outside the GDN output norm is zero-centred: y = norm(x) (1 + w).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_KINDS = (LINEAR_ATTENTION, FULL_ATTENTION)


@dataclass(frozen=True)
class LinearAttentionShape:
    """The Gated DeltaNet layers' sizes (config.json `linear_*`)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def heads_per_key(self) -> int:
        """Value heads that read one key head."""
        return self.value_heads // self.key_heads

    @property
    def conv_channels(self) -> int:
        """Channels of the convolved q, k, v: 2 key_heads key_dim + value_heads value_dim."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def qwen3_5_linear_attention(config: Mapping[str, Any]) -> LinearAttentionShape:
    """The GDN sizes of a Qwen3.5 text config (transformers' defaults where one is left out)."""
    return LinearAttentionShape(
        key_heads=int(config.get("linear_num_key_heads", 16)),
        value_heads=int(config.get("linear_num_value_heads", 32)),
        key_dim=int(config.get("linear_key_head_dim", 128)),
        value_dim=int(config.get("linear_value_head_dim", 128)),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
    )


def qwen3_5_layer_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The token mixer of each decoder layer, as written (unknown kinds included: the caller
    refuses them) or, when left out, transformers' default pattern."""
    written = config.get("layer_types")
    if written is not None:
        return tuple(str(kind) for kind in written)
    interval = int(config.get("full_attention_interval", 4))
    layers = int(config["num_hidden_layers"])
    return tuple(
        FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
    )


def unknown_layer_types(layer_types: tuple[str, ...]) -> list[str]:
    """The kinds in `layer_types` mtprun does not build, in first-seen order."""
    return list(dict.fromkeys(kind for kind in layer_types if kind not in LAYER_KINDS))
