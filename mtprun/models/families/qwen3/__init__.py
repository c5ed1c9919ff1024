"""Qwen3 (`Qwen3ForCausalLM`): the shared decoder trunk with per-head q/k norms; it has
`attention_bias` (false in every released checkpoint)."""

from __future__ import annotations

from mtprun.models.family import Family, always, attention_bias

NAME = "qwen3"
FAMILIES = (
    Family(
        "Qwen3ForCausalLM",
        "Qwen3ForCausalLM",
        qkv_bias=attention_bias,
        qk_norm=always,
        renderer="qwen3",
        model_type="qwen3",
        tiny=NAME,
        tiny_config="Qwen3Config",
    ),
)
