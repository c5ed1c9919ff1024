"""Qwen2 (`Qwen2ForCausalLM`): the decoder trunk every family shares, with q/k/v biases."""

from __future__ import annotations

from mtprun.models.family import Family, always

NAME = "qwen2"
FAMILIES = (Family("Qwen2ForCausalLM", "Qwen2ForCausalLM", qkv_bias=always, tiny=NAME),)
