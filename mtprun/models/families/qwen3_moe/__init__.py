"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention with a mixture-of-experts MLP (softmax
top-k router, no shared expert), mapped by the shared `mtprun.models.moe`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mtprun.models.expert_shape import ExpertShape
from mtprun.models.family import DECODER, MOE, Family, always, attention_bias

if TYPE_CHECKING:
    from mtprun.spec.model import TinyModel

NAME = "qwen3_moe"


def experts(config: Mapping[str, Any]) -> ExpertShape:
    """Softmax router, no shared expert; layer i is sparse unless it is listed in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`."""
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return ExpertShape(
        # transformers 5 writes the count as num_local_experts; the released configs as
        # num_experts.
        count=int(config.get("num_experts") or config["num_local_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        intermediate=int(config["moe_intermediate_size"]),
        normalize_top_k=bool(config.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in dense_only or (i + 1) % step),
    )


def tiny_fields(spec: TinyModel) -> dict[str, Any]:
    """A tiny model's expert config fields: every layer sparse."""
    moe = spec.experts
    return {
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.intermediate,
        "norm_topk_prob": True,  # as the released checkpoints
        "num_experts": moe.count,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


FAMILIES = (
    Family(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        qkv_bias=attention_bias,
        qk_norm=always,
        experts=experts,
        converters=(DECODER, MOE),
        renderer="qwen3",
        model_type="qwen3_moe",
        tiny=NAME,
        tiny_config="Qwen3MoeConfig",
        tiny_fields=tiny_fields,
    ),
)
