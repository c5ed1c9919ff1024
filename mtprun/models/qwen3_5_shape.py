"""The layer kinds of a hybrid model (Qwen3.5's, whose folder `mtprun.models.families.qwen3_5`
reads them from its config.json), no torch: `mtprun validate` reads it.

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

from dataclasses import dataclass

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


def unknown_layer_types(layer_types: tuple[str, ...]) -> list[str]:
    """The kinds in `layer_types` mtprun does not build, in first-seen order."""
    return list(dict.fromkeys(kind for kind in layer_types if kind not in LAYER_KINDS))
