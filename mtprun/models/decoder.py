"""The Qwen2-style decoder trunk every family shares, HF <-> Megatron-core GPTModel (local layer
spec): embedding, decoder layers, final norm, untied output layer. q/k/v biases (Qwen2, MiMo)
and per-head q/k norms (Qwen3) are mapped when the shape has them; the MLP of a layer with
experts is left to `mtprun.models.moe`.

Megatron fuses q/k/v into one `linear_qkv` laid out per query group
([q heads of group g, k_g, v_g] for g = 0..G-1) so that a contiguous split over tensor-parallel
ranks gives every rank whole groups, and fuses gate/up into `linear_fc1` as [gate; up].
Names here are the full (TP=1) tensors; `mtprun.models.tp_layout` splits them per rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mtprun.models.shape import ModelShape

Tensors = Mapping[str, torch.Tensor]

# HF layer suffix -> Megatron layer suffix, for the tensors that map one to one.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
}
# The same, for a shape with per-head q/k norms (megatron-core's `qk_layernorm`).
_QK_NORM_RENAMES = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


def _renames(shape: ModelShape) -> dict[str, str]:
    return {**_LAYER_RENAMES, **_QK_NORM_RENAMES} if shape.qk_norm else _LAYER_RENAMES


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """[q; k; v] (HF, weights or biases) -> Megatron's per-group interleaved linear_qkv."""
    groups, per_group, d = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    rest = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group, d, *rest),
            k.reshape(groups, 1, d, *rest),
            v.reshape(groups, 1, d, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, shape: ModelShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv."""
    groups, per_group, d = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, d, *rest)
    q, k, v = grouped.split([per_group, 1, 1], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def layer_to_megatron(
    hf: Tensors, hf_prefix: str, mg_prefix: str, shape: ModelShape, dense_mlp: bool = True
) -> dict:
    """One decoder layer: HF tensors under `hf_prefix` -> Megatron tensors under `mg_prefix`;
    its MLP too when `dense_mlp` (a mixture-of-experts MLP is `mtprun.models.moe`'s)."""
    out = {mg_prefix + m: hf[hf_prefix + h] for h, m in _renames(shape).items()}
    attn = hf_prefix + "self_attn."
    out[mg_prefix + "self_attention.linear_qkv.weight"] = fuse_qkv(
        hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape
    )
    if shape.qkv_bias:
        out[mg_prefix + "self_attention.linear_qkv.bias"] = fuse_qkv(
            hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape
        )
    if dense_mlp:
        out.update(mlp_to_megatron(hf, hf_prefix + "mlp.", mg_prefix + "mlp."))
    return out


def mlp_to_megatron(hf: Tensors, hf_prefix: str, mg_prefix: str) -> dict:
    """A SwiGLU MLP: gate/up/down projections -> linear_fc1 ([gate; up]) and linear_fc2."""
    gate_up = [hf[hf_prefix + "gate_proj.weight"], hf[hf_prefix + "up_proj.weight"]]
    return {
        mg_prefix + "linear_fc1.weight": torch.cat(gate_up),
        mg_prefix + "linear_fc2.weight": hf[hf_prefix + "down_proj.weight"],
    }


def mlp_to_hf(mg: Tensors, mg_prefix: str, hf_prefix: str) -> dict:
    """Inverse of mlp_to_megatron."""
    gate, up = mg[mg_prefix + "linear_fc1.weight"].chunk(2)
    return {
        hf_prefix + "gate_proj.weight": gate.contiguous(),
        hf_prefix + "up_proj.weight": up.contiguous(),
        hf_prefix + "down_proj.weight": mg[mg_prefix + "linear_fc2.weight"],
    }


def layer_to_hf(
    mg: Tensors, mg_prefix: str, hf_prefix: str, shape: ModelShape, dense_mlp: bool = True
) -> dict:
    """Inverse of layer_to_megatron."""
    out = {hf_prefix + h: mg[mg_prefix + m] for h, m in _renames(shape).items()}
    attn = hf_prefix + "self_attn."
    qkv = split_qkv(mg[mg_prefix + "self_attention.linear_qkv.weight"], shape)
    out.update(zip((attn + f"{p}_proj.weight" for p in "qkv"), qkv, strict=True))
    if shape.qkv_bias:
        qkv_bias = split_qkv(mg[mg_prefix + "self_attention.linear_qkv.bias"], shape)
        out.update(zip((attn + f"{p}_proj.bias" for p in "qkv"), qkv_bias, strict=True))
    if dense_mlp:
        out.update(mlp_to_hf(mg, mg_prefix + "mlp.", hf_prefix + "mlp."))
    return out


def _outside_layers(shape: ModelShape) -> dict[str, str]:
    """HF name -> Megatron name of the trunk's tensors outside the decoder layers."""
    names = {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
    }
    if not shape.tie_embeddings:
        names["lm_head.weight"] = "output_layer.weight"
    return names


def to_megatron(hf: Tensors, shape: ModelShape, experts: range) -> dict:
    """Embedding, decoder layers, final norm and (untied) output layer (`experts`, the routed
    experts a rank holds, are `mtprun.models.moe`'s)."""
    out = {m: hf[h] for h, m in _outside_layers(shape).items()}
    for i in range(shape.layers):
        hf_layer, mg_layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update(layer_to_megatron(hf, hf_layer, mg_layer, shape, not shape.is_moe_layer(i)))
    return out


def part_layers(shape: ModelShape, part: range | None) -> range:
    """The decoder layers a conversion of `part` covers (None: the whole model)."""
    return range(shape.layers) if part is None else range(part.start, min(part.stop, shape.layers))


def converts_outside(part: range | None) -> bool:
    """Whether a conversion of `part` covers the tensors outside the decoder layers
    (embedding, final norm, output layer, MTP layers): the whole model's, or the first part's."""
    return part is None or part.start == 0


def to_hf(mg: Tensors, shape: ModelShape, part: range | None = None) -> dict:
    """Inverse of to_megatron; with `part`, those decoder layers (`part_layers`) alone, and the
    tensors outside them with the first part."""
    out = {h: mg[m] for h, m in _outside_layers(shape).items()} if converts_outside(part) else {}
    for i in part_layers(shape, part):
        hf_layer, mg_layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update(layer_to_hf(mg, mg_layer, hf_layer, shape, not shape.is_moe_layer(i)))
    return out
