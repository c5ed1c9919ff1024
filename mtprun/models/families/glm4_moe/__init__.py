"""GLM-4.5 / 4.6 / -Air (`Glm4MoeForCausalLM`): leading dense layers, then a sigmoid router with
a correction bias and grouped top-k over routed experts plus a shared expert (the shared
`mtprun.models.moe`); q/k/v biases, optional q/k norms, RoPE over part of each head;
DeepSeek-V3-style MTP layers after the decoder's (`model.layers.{num_hidden_layers + i}`),
served as vLLM's `glm4_moe_mtp` drafter.

Submodules (torch): `mtp` maps the MTP layers' tensors, `tiny` draws them for a tiny model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mtprun.models.expert_shape import ExpertShape
from mtprun.models.family import DECODER, MOE, Config, Family, VllmServing, attention_bias

if TYPE_CHECKING:
    from mtprun.spec.model import TinyModel

NAME = "glm4_moe"


def experts(config: Mapping[str, Any]) -> ExpertShape:
    """Sigmoid router with a per-expert score-correction bias and grouped top-k, scaled
    weights, `n_shared_experts` shared experts (one MLP of their summed width); the first
    `first_k_dense_replace` layers are dense."""
    shared = int(config.get("n_shared_experts") or 0)
    width = int(config["moe_intermediate_size"])
    return ExpertShape(
        count=int(config["n_routed_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        intermediate=width,
        normalize_top_k=bool(config.get("norm_topk_prob", True)),
        score="sigmoid",
        score_bias=True,
        groups=int(config.get("n_group") or 1),
        group_top_k=int(config.get("topk_group") or 1),
        scaling=float(config.get("routed_scaling_factor") or 1.0),
        shared_intermediate=shared * width,
        dense_layers=tuple(range(int(config.get("first_k_dense_replace") or 0))),
    )


def use_qk_norm(config: Config) -> bool:
    return bool(config.get("use_qk_norm", False))


def mtp_tensors(layers: int, i: int) -> tuple[str, ...]:
    """The own tensors of MTP layer i (DeepSeek-V3 style): `model.layers.{layers + i}.`
    (`mtp`)."""
    own = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
    return tuple(f"model.layers.{layers + i}.{name}.weight" for name in own)


_MTP_COPY = re.compile(r"^model\.layers\.(\d+)\.(shared_head\.head|embed_tokens)\.weight$")


def mtp_copy(name: str, layers: int) -> bool:
    """An MTP layer's copy of the trunk's output layer or embedding (the drafter uses the
    trunk's own): left out of conversion."""
    match = _MTP_COPY.match(name)
    return match is not None and int(match.group(1)) >= layers


def tiny_fields(spec: TinyModel) -> dict[str, Any]:
    """A tiny model's expert config fields: every layer sparse except the first when there
    are several (as `first_k_dense_replace` keeps it dense), one shared expert."""
    moe = spec.experts
    return {
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.intermediate,
        "norm_topk_prob": True,  # as the released checkpoints
        "n_routed_experts": moe.count,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1 if spec.layers > 1 else 0,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    }


def tiny_shape(spec: TinyModel) -> dict[str, Any]:
    """A tiny GLM-4.5 rotates half of each head (transformers' default)."""
    return {"rotary_fraction": 0.5}


class Glm4MoeServing(VllmServing):
    def hf_overrides(self, config: Config) -> dict[str, Any] | None:
        """vLLM 0.32's GLM-4.5 model (`Glm4MoeForCausalLM`, and its `glm4_moe_mtp` drafter)
        reads `config.head_dim` with no fallback, while transformers' `Glm4MoeConfig` declares
        no such field (its attention takes hidden / heads): GLM's released config.json files
        name it, a folder written from a `Glm4MoeConfig` (a tiny one) does not, and vLLM fails
        building the first layer (`'Glm4MoeConfig' object has no attribute 'head_dim'`). The
        default is transformers', so both run the same attention."""
        if config.get("head_dim"):
            return None
        return {"head_dim": config["hidden_size"] // config["num_attention_heads"]}


FAMILIES = (
    Family(
        "Glm4MoeForCausalLM",
        "Glm4MoeForCausalLM",
        qkv_bias=attention_bias,
        qk_norm=use_qk_norm,
        mtp=True,
        mtp_embedding_first=True,
        mtp_normed_hidden=True,
        mtp_tensors=mtp_tensors,
        experts=experts,
        converters=(DECODER, MOE, f"{__name__}.mtp"),
        unconverted=mtp_copy,
        vllm=Glm4MoeServing(),
        renderer="glm-4.5",
        model_type="glm4_moe",
        tiny=NAME,
        tiny_config="Glm4MoeConfig",
        tiny_fields=tiny_fields,
        tiny_shape=tiny_shape,
        tiny_mtp_tensors=f"{__name__}.tiny:mtp_tensors",
        mtp_in_decoder_layers=True,
    ),
)
