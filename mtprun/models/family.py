"""Model families: one `Family` each, and the registry every list of architectures comes from.

A family says which HF `architectures` entry it reads, what it adds to the `ModelShape` (q/k/v
biases, per-head q/k norms, MTP layers, a mixture-of-experts MLP; the Megatron-core layer-spec
options follow from those, `ModelShape.megatron_layer_options`), which modules map its tensors
HF <-> Megatron both ways (`converters`: every family's tp layout is
`mtprun.models.tp_layout`'s, by tensor name; q/k norms are per head, so replicated), the vLLM
architecture that serves its export, and the transformers config class its tiny builder
(`mtprun.models.tiny`) draws from.

`FAMILIES` is the only list: the supported architectures, the `model.tiny.architecture` names
and the conversion dispatch are derived from it. A new family is one entry appended here (and
its converter module when its tensors are not the Qwen2-style decoder's). This module imports
no torch: `mtprun validate` reads shapes through it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mtprun.models.expert_shape import ExpertShape, glm4_moe_experts, qwen3_moe_experts
from mtprun.models.folder_tensors import (
    MtpTensors,
    deepseek_mtp_tensors,
    mimo_mtp_tensors,
    qwen3_5_mtp_tensors,
)
from mtprun.models.qwen3_5_shape import (
    LinearAttentionShape,
    qwen3_5_layer_types,
    qwen3_5_linear_attention,
)

# The Qwen2-style decoder trunk (embedding, layers, final norm, output layer): every family's.
DECODER = "mtprun.models.decoder"


@dataclass(frozen=True)
class Family:
    """One HF architecture mtprun converts, trains, serves and exports."""

    architecture: str  # the HF `architectures` entry it reads
    vllm_architecture: str  # the vLLM model class that serves its export
    qkv_bias: Callable[[Mapping[str, Any]], bool]  # whether a config.json's model has them
    # RMSNorm over each query / key head before RoPE, as a config.json declares it.
    qk_norm: Callable[[Mapping[str, Any]], bool] = lambda config: False
    mtp: bool = False  # MTP layers (`num_nextn_predict_layers`), trained and served as drafter
    # Its MTP layers' input: [embedding, hidden] (DeepSeek-V3, GLM-4.5) or [hidden, embedding]
    # (MiMo).
    mtp_embedding_first: bool = False
    # Its vLLM drafter zeroes the next token's embedding at position 0 (MiMo, DeepSeek-V3,
    # GLM-4.5); Qwen3.5's does not.
    mtp_zero_first_embedding: bool = True
    # Its vLLM drafter reads the trunk's final-normed hidden state (and, chained, its own
    # normed output) rather than the pre-norm one: GLM-4.5 (vLLM's Glm4MoeModel returns the
    # normed state, as megatron-core's MTP block takes it) and Qwen3.5; MiMo's reads pre-norm.
    mtp_normed_hidden: bool = False
    # Checkpoint tensors it leaves out of conversion: (HF name, num_hidden_layers) -> bool;
    # e.g. an MTP layer not trained yet. None: every tensor must convert.
    unconverted: Callable[[str, int], bool] | None = None
    # Its mixture-of-experts MLP as a config.json declares it; None: a dense model.
    experts: Callable[[Mapping[str, Any]], ExpertShape] | None = None
    converters: tuple[str, ...] = (DECODER,)  # modules with to_megatron / to_hf, in order
    # A hybrid model's token mixer per layer (`mtprun.models.qwen3_5_shape`) and its linear
    # attention sizes; None: every layer is softmax attention.
    layer_types: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    linear_attention: Callable[[Mapping[str, Any]], LinearAttentionShape] | None = None
    output_gate: bool = False  # attention output * sigmoid(gate), the gate from q_proj
    zero_centered_norm: bool = False  # RMSNorm weights w applied as (1 + w)
    # Its config.json keeps the text model's fields under `text_config` (a vision-language
    # checkpoint whose text model mtprun trains).
    text_config: bool = False
    mtp_layers_key: str = "num_nextn_predict_layers"  # config.json's MTP layer count
    # The HF names of MTP layer i's own tensors (`mtprun.models.folder_tensors`): a folder
    # that holds none of them (written by transformers) trains without its MTP layers.
    mtp_tensors: MtpTensors | None = None
    tiny: str | None = None  # its `model.tiny.architecture` name; None: no tiny builder
    tiny_config: str = "Qwen2Config"  # the transformers config class its tiny builder uses


def _always(config: Mapping[str, Any]) -> bool:
    return True


def _attention_bias(config: Mapping[str, Any]) -> bool:
    return bool(config.get("attention_bias", False))


def _use_qk_norm(config: Mapping[str, Any]) -> bool:
    return bool(config.get("use_qk_norm", False))


_MTP_COPY = re.compile(r"^model\.layers\.(\d+)\.(shared_head\.head|embed_tokens)\.weight$")


def _mtp_copy(name: str, layers: int) -> bool:
    """A DeepSeek-V3-style MTP layer's copy of the trunk's output layer or embedding (the
    drafter uses the trunk's own)."""
    match = _MTP_COPY.match(name)
    return match is not None and int(match.group(1)) >= layers


def _qwen3_5_unconverted(name: str, layers: int) -> bool:
    """A Qwen3.5 checkpoint's vision tower (carried through to the export as it is)."""
    return name.startswith("model.visual.")


# Qwen3.5: Gated DeltaNet and gated attention layers in `layer_types` order, q/k norms,
# zero-centred RMSNorms, partial RoPE; as a text model or the text part of the
# vision-language checkpoint (`model.language_model.`); its MTP layer (`mtp.`, a gated
# attention layer after [embedding, hidden]) as vLLM's `qwen3_5_mtp` drafter.
_QWEN3_5 = {
    "mtp": True,
    "mtp_embedding_first": True,
    "mtp_zero_first_embedding": False,
    "mtp_normed_hidden": True,
    "qkv_bias": _attention_bias,
    "qk_norm": _always,
    "converters": ("mtprun.models.qwen3_5",),
    "unconverted": _qwen3_5_unconverted,
    "layer_types": qwen3_5_layer_types,
    "linear_attention": qwen3_5_linear_attention,
    "output_gate": True,
    "zero_centered_norm": True,
    "mtp_layers_key": "mtp_num_hidden_layers",
    "mtp_tensors": qwen3_5_mtp_tensors,
}

FAMILIES: tuple[Family, ...] = (
    Family("Qwen2ForCausalLM", "Qwen2ForCausalLM", qkv_bias=_always, tiny="qwen2"),
    Family("LlamaForCausalLM", "LlamaForCausalLM", qkv_bias=_attention_bias),
    Family(
        "MiMoForCausalLM",
        "MiMoForCausalLM",  # and its MTP layers as vLLM's `mtp` drafter
        qkv_bias=_always,
        mtp=True,
        mtp_tensors=mimo_mtp_tensors,
        converters=(DECODER, "mtprun.models.mimo"),
        tiny="mimo",
    ),
    # Qwen3 has `attention_bias` (false in every released checkpoint) and q/k norms.
    Family(
        "Qwen3ForCausalLM",
        "Qwen3ForCausalLM",
        qkv_bias=_attention_bias,
        qk_norm=_always,
        tiny="qwen3",
        tiny_config="Qwen3Config",
    ),
    # Qwen3 attention with a mixture-of-experts MLP (softmax top-k router, no shared expert).
    Family(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        qkv_bias=_attention_bias,
        qk_norm=_always,
        experts=qwen3_moe_experts,
        converters=(DECODER, "mtprun.models.moe"),
        tiny="qwen3_moe",
        tiny_config="Qwen3MoeConfig",
    ),
    # GLM-4.5 / 4.6 / -Air: leading dense layers, then a sigmoid router with a correction bias
    # and grouped top-k over routed experts plus a shared expert; q/k/v biases, optional q/k
    # norms, RoPE over part of each head; DeepSeek-V3-style MTP layers after the decoder's
    # (`model.layers.{num_hidden_layers + i}`), vLLM's `glm4_moe_mtp` drafter.
    Family(
        "Glm4MoeForCausalLM",
        "Glm4MoeForCausalLM",
        qkv_bias=_attention_bias,
        qk_norm=_use_qk_norm,
        mtp=True,
        mtp_embedding_first=True,
        mtp_normed_hidden=True,
        mtp_tensors=deepseek_mtp_tensors,
        experts=glm4_moe_experts,
        converters=(DECODER, "mtprun.models.moe", "mtprun.models.glm_mtp"),
        unconverted=_mtp_copy,
        tiny="glm4_moe",
        tiny_config="Glm4MoeConfig",
    ),
    Family(
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForCausalLM",
        tiny="qwen3_5",
        tiny_config="Qwen3_5TextConfig",
        **_QWEN3_5,
    ),
    Family(
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        text_config=True,
        **_QWEN3_5,
    ),
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(f.architecture for f in FAMILIES)
"""HF `architectures` entries whose weights mtprun can convert to Megatron-core and back."""

TINY_ARCHITECTURES: dict[str, str] = {f.tiny: f.architecture for f in FAMILIES if f.tiny}
"""The HF architecture each `model.tiny.architecture` builds."""

_BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES}


def family_of(architecture: str) -> Family:
    """The family of a supported HF architecture (KeyError for any other)."""
    return _BY_ARCHITECTURE[architecture]
