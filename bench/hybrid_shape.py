"""Qwen3.5's hybrid shape for `bench/trainer_gpu.py`: Gated DeltaNet layers and, every
`full_every`-th layer, gated attention (issue 27's bench).

The model folder is written from transformers' `Qwen3_5TextConfig` (random init), as the
tiny builder's fixed GDN widths do not reach the real model's (16 key heads and 32 value heads
of 128 on Qwen3.5-9B).

Model FLOPs of a step (forward + backward = 3 x forward for every matmul):
- 6 x (non-embedding parameters + H V) a token, the parameters counted below;
- full-attention layers: 6 L_full Q s a token (as `Shape.step_flops`, Q = heads x head_dim);
- Gated DeltaNet layers: 3 x `gated_delta_flops` (the chunked algorithm's forward matmuls,
  chunk 64, causal masks not discounted) per layer over the step's tokens; the short
  convolution, gates and norms are elementwise and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mtprun.kernels.gated_delta import gated_delta_flops


@dataclass(frozen=True)
class HybridShape:
    """A Qwen3.5 text model's shape (the `Shape` interface `trainer_gpu.py` reads)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int
    key_heads: int  # Gated DeltaNet
    value_heads: int
    key_dim: int
    value_dim: int
    conv: int = 4
    full_every: int = 4
    architecture: str = "qwen3_5"

    @property
    def full_layers(self) -> int:
        return self.layers // self.full_every

    @property
    def linear_layers(self) -> int:
        return self.layers - self.full_layers

    @property
    def body_params(self) -> int:
        """Parameters outside the embedding and output layer."""
        h, d = self.hidden, self.head_dim
        # gated attention: q_proj gives the query and its gate; q/k norms of head_dim
        attention = h * 2 * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        attention += 2 * d
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        # GDN: in projections of q, k, v, z (v wide), b and a (one per value head); the conv
        # over q, k, v; A_log, dt_bias; the output norm (value_dim); out_proj
        linear = h * (2 * qk + 2 * v + 2 * self.value_heads) + (2 * qk + v) * self.conv
        linear += 2 * self.value_heads + self.value_dim + v * h
        mlp_and_norms = 3 * h * self.ffn + 2 * h
        per_layer = self.full_layers * attention + self.linear_layers * linear
        return per_layer + self.layers * mlp_and_norms + h

    def step_flops(self, lengths: list[int], lora_rank: int = 0) -> float:
        if lora_rank:
            raise SystemExit("--lora: the hybrid shape's LoRA FLOPs are not counted")
        tokens = sum(lengths)
        dense = 6 * (self.body_params + self.hidden * self.vocab) * tokens
        query = self.heads * self.head_dim
        full = 6 * self.full_layers * query * sum(n * n for n in lengths)
        # the value heads each read one key head's q and k (repeated)
        delta = (
            3
            * self.linear_layers
            * gated_delta_flops(tokens, self.value_heads, self.key_dim, self.value_dim)
        )
        return dense + full + delta

    def build_folder(self, folder: Path, max_seq_len: int, tokenizer) -> None:
        """A random-init `Qwen3_5ForCausalLM` folder of this shape (weights in torch's
        default dtype and device) with `tokenizer`."""
        from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

        kinds = ["linear_attention"] * (self.full_every - 1) + ["full_attention"]
        config = Qwen3_5TextConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.key_heads, linear_num_value_heads=self.value_heads,
            linear_key_head_dim=self.key_dim, linear_value_head_dim=self.value_dim,
            linear_conv_kernel_dim=self.conv, full_attention_interval=self.full_every,
            layer_types=kinds * (self.layers // self.full_every),
            max_position_embeddings=max_seq_len, tie_word_embeddings=False,
            mtp_num_hidden_layers=0, bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        config.architectures = ["Qwen3_5ForCausalLM"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)


QWEN3_5_9B = HybridShape(
    "qwen3.5-9b", 4096, 32, 16, 4, 12288, 248320, head_dim=256,
    key_heads=16, value_heads=32, key_dim=128, value_dim=128,
)  # fmt: skip
# --cpu-dry-run: the same pattern at tiny sizes
CPU_QWEN3_5 = HybridShape(
    "cpu-tiny-qwen3_5", 128, 4, 4, 2, 256, 256, head_dim=32,
    key_heads=2, value_heads=4, key_dim=32, value_dim=32,
)  # fmt: skip
