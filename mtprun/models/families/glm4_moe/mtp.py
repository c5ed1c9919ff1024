"""GLM-4.5's multi-token-prediction layers (DeepSeek-V3 style): HF names <-> mtprun's
Megatron MTP module names.

HF (and vLLM's `Glm4MoeMTP` drafter) layout of MTP layer i, under `model.layers.{L + i}.`
(L = num_hidden_layers): `enorm` (the next token's embedding), `hnorm` (the trunk's hidden
state), `eh_proj` ([H, 2H], input = [normed embedding, normed hidden]: embedding first),
`shared_head.norm` (its final norm), and a decoder layer (a sparse one: its index is past
`first_k_dense_replace`) stored directly under the same prefix. Its output layer and
embedding are the trunk's: vLLM maps `lm_head` / `model.embed_tokens` onto the drafter's, so
copies a checkpoint may store (`shared_head.head`, `embed_tokens`) are left out
(`Family.unconverted`). mtprun's Megatron-side module (`mtprun.runner.trainer.model.MTPLayer`)
keeps the MiMo names, with the embedding-first input order.
"""

from __future__ import annotations

from mtprun.models import decoder, moe
from mtprun.models.shape import ModelShape

# HF suffix -> Megatron suffix of an MTP layer's own tensors.
_MTP_RENAMES = {
    "enorm.weight": "token_layernorm.weight",
    "hnorm.weight": "hidden_layernorm.weight",
    "eh_proj.weight": "input_proj.weight",
    "shared_head.norm.weight": "final_layernorm.weight",
}


def _prefixes(shape: ModelShape, i: int) -> tuple[str, str]:
    return f"model.layers.{shape.layers + i}.", f"mtp_layers.{i}."


def to_megatron(hf: decoder.Tensors, shape: ModelShape, experts: range) -> dict:
    """The MTP layers' tensors (the trunk's are `decoder` and `moe`'s), of the routed
    `experts` a rank holds."""
    out = {}
    for i in range(shape.mtp_layers):
        hf_prefix, mg_prefix = _prefixes(shape, i)
        out.update({mg_prefix + m: hf[hf_prefix + h] for h, m in _MTP_RENAMES.items()})
        layer = mg_prefix + "decoder_layer."
        out.update(decoder.layer_to_megatron(hf, hf_prefix, layer, shape, dense_mlp=False))
        out.update(moe.moe_to_megatron(hf, hf_prefix + "mlp.", layer + "mlp.", shape, experts))
    return out


def to_hf(mg: decoder.Tensors, shape: ModelShape, part: range | None = None) -> dict:
    """Inverse of to_megatron (the MTP layers: with the first part, `decoder.converts_outside`)."""
    out = {}
    for i in range(shape.mtp_layers if decoder.converts_outside(part) else 0):
        hf_prefix, mg_prefix = _prefixes(shape, i)
        out.update({hf_prefix + h: mg[mg_prefix + m] for h, m in _MTP_RENAMES.items()})
        layer = mg_prefix + "decoder_layer."
        out.update(decoder.layer_to_hf(mg, layer, hf_prefix, shape, dense_mlp=False))
        out.update(moe.moe_to_hf(mg, layer + "mlp.", hf_prefix + "mlp.", shape))
    return out
