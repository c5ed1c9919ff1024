"""MiMo multi-token-prediction layers: HF names <-> mtprun's Megatron MTP module names.

HF (and vLLM's MiMo drafter) layout of MTP layer i, under `model.mtp_layers.{i}.`:
token_layernorm, hidden_layernorm, input_proj ([H, 2H], input = [trunk hidden, token emb]),
final_layernorm, and a Qwen2 decoder layer stored directly under the same prefix.
mtprun's Megatron-side module (`mtprun.runner.trainer.model.MTPLayer`) keeps MiMo's
input order, so input_proj maps unchanged; the decoder layer sits under `decoder_layer.`.
"""

from __future__ import annotations

from mtprun.models import decoder
from mtprun.models.shape import ModelShape

_MTP_RENAMES = (
    "token_layernorm.weight",
    "hidden_layernorm.weight",
    "input_proj.weight",
    "final_layernorm.weight",
)


def to_megatron(hf: decoder.Tensors, shape: ModelShape, experts: range) -> dict:
    """The MTP layers' tensors (the trunk's are `decoder.to_megatron`'s; MiMo has no routed
    `experts`)."""
    out = {}
    for i in range(shape.mtp_layers):
        hf_prefix, mg_prefix = f"model.mtp_layers.{i}.", f"mtp_layers.{i}."
        out.update({mg_prefix + n: hf[hf_prefix + n] for n in _MTP_RENAMES})
        out.update(decoder.layer_to_megatron(hf, hf_prefix, mg_prefix + "decoder_layer.", shape))
    return out


def to_hf(mg: decoder.Tensors, shape: ModelShape, part: range | None = None) -> dict:
    """Inverse of to_megatron (the MTP layers: with the first part, `decoder.converts_outside`)."""
    out = {}
    for i in range(shape.mtp_layers if decoder.converts_outside(part) else 0):
        hf_prefix, mg_prefix = f"model.mtp_layers.{i}.", f"mtp_layers.{i}."
        out.update({hf_prefix + n: mg[mg_prefix + n] for n in _MTP_RENAMES})
        out.update(decoder.layer_to_hf(mg, mg_prefix + "decoder_layer.", hf_prefix, shape))
    return out
