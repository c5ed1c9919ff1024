"""Llama (`LlamaForCausalLM`): the shared decoder trunk, q/k/v biases as `attention_bias` says."""

from __future__ import annotations

from mtprun.models.family import Family, attention_bias

NAME = "llama"
FAMILIES = (Family("LlamaForCausalLM", "LlamaForCausalLM", qkv_bias=attention_bias),)
