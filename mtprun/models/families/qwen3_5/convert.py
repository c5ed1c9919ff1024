"""Qwen3.5 (`Qwen3_5ForCausalLM`, and the text model of `Qwen3_5ForConditionalGeneration`)
HF <-> Megatron-core names, both ways.

The text model's tensors sit under `model.` (text checkpoint) or `model.language_model.`
(vision-language checkpoint, whose `model.visual.` tower is not converted: the export carries
it through from the source folder as it is). Decoder layer i is, by `layer_types[i]`:

- gated attention (`self_attn.`): q_proj rows are per head [query (d); gate (d)]. Megatron's
  `linear_qkv` with `attention_output_gate` is laid out per query group g as
  [queries of g; gates of g; key g; value g], so a contiguous tensor-parallel split gives every
  rank whole groups. q/k norms per head, as Qwen3.
- Gated DeltaNet (`linear_attn.` -> `self_attention.` of
  `mtprun.runner.trainer.gated_delta_net.PackedGatedDeltaNet`): in_proj_qkv rows (and the
  depthwise conv's channels) [q (Hk kd); k (Hk kd); v (Hv vd)] are laid out per key head g as
  [q_g; k_g; v of the value heads that read g], again so that a contiguous split gives every
  rank whole key heads with their value heads; z, b, a, A_log and dt_bias are per value head
  already in that order; conv1d [C, 1, W] is stored [C, W].

The MTP layer (`mtp.`: `fc` over [normed embedding; normed hidden], `pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, `norm`, and a gated attention layer under `mtp.layers.0.`) maps onto
mtprun's MTP head (`mtp_layers.0.`, `mtprun.runner.trainer.model.MTPLayer`, embedding first).

Every norm weight maps unchanged (the zero-centred (1 + w) is applied by the Megatron-side
norm, `ZeroCenteredRMSNorm`, so no value is rounded by a +1 in bf16).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from safetensors import safe_open

from mtprun.models import decoder
from mtprun.models.shape import ModelShape

Tensors = decoder.Tensors
VISION_PREFIX = "model.visual."

# HF layer suffix -> Megatron layer suffix, one to one.
_COMMON = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_ATTENTION = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_LINEAR = {
    "linear_attn.in_proj_z.weight": "self_attention.in_proj_z.weight",
    "linear_attn.in_proj_b.weight": "self_attention.in_proj_b.weight",
    "linear_attn.in_proj_a.weight": "self_attention.in_proj_a.weight",
    "linear_attn.A_log": "self_attention.A_log",
    "linear_attn.dt_bias": "self_attention.dt_bias",
    "linear_attn.norm.weight": "self_attention.out_norm.weight",
    "linear_attn.out_proj.weight": "self_attention.out_proj.weight",
}


def text_prefix(shape: ModelShape) -> str:
    """Where the text model's tensors sit in the HF checkpoint."""
    if shape.architecture == "Qwen3_5ForConditionalGeneration":
        return "model.language_model."
    return "model."


def fuse_gated_qkv(
    q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape
) -> torch.Tensor:
    """HF q_proj ([query; gate] per head), k_proj, v_proj -> Megatron's gated linear_qkv,
    per query group [queries; gates; key; value]."""
    groups, per_group, d = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    rest = q_proj.shape[1:]
    query_gate = q_proj.reshape(groups, per_group, 2, d, *rest)
    fused = torch.cat(
        [
            query_gate[:, :, 0].reshape(groups, per_group * d, *rest),
            query_gate[:, :, 1].reshape(groups, per_group * d, *rest),
            k.reshape(groups, d, *rest),
            v.reshape(groups, d, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def split_gated_qkv(
    qkv: torch.Tensor, shape: ModelShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_gated_qkv: (q_proj, k_proj, v_proj)."""
    groups, per_group, d = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, 2 * per_group + 2, d, *rest)
    query, gate, k, v = grouped.split([per_group, per_group, 1, 1], dim=1)
    q_proj = torch.stack([query, gate], dim=2).reshape(-1, *rest)
    return q_proj.contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


def group_by_key_head(qkv: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """GDN [q; k; v] channels (rows of in_proj_qkv, or the conv's) -> per key head g
    [q_g; k_g; v of g's value heads]."""
    linear = shape.linear_attention
    assert linear is not None
    heads, kd = linear.key_heads, linear.key_dim
    rest = qkv.shape[1:]
    q, k, v = qkv.split([heads * kd, heads * kd, linear.value_heads * linear.value_dim])
    fused = torch.cat(
        [q.reshape(heads, kd, *rest), k.reshape(heads, kd, *rest), v.reshape(heads, -1, *rest)],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def ungroup_by_key_head(fused: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Inverse of group_by_key_head."""
    linear = shape.linear_attention
    assert linear is not None
    heads, kd = linear.key_heads, linear.key_dim
    rest = fused.shape[1:]
    per_head = linear.heads_per_key * linear.value_dim
    q, k, v = fused.reshape(heads, 2 * kd + per_head, *rest).split([kd, kd, per_head], dim=1)
    return torch.cat([t.reshape(-1, *rest) for t in (q, k, v)]).contiguous()


def _layer_to_megatron(
    hf: Tensors, hf_prefix: str, mg_prefix: str, shape: ModelShape, i: int | None
) -> dict:
    """Decoder layer `i` (None: the MTP layer's, gated attention) HF -> Megatron."""
    out = {mg_prefix + m: hf[hf_prefix + h] for h, m in _COMMON.items()}
    out.update(decoder.mlp_to_megatron(hf, hf_prefix + "mlp.", mg_prefix + "mlp."))
    if i is not None and shape.is_linear_attention_layer(i):
        out.update({mg_prefix + m: hf[hf_prefix + h] for h, m in _LINEAR.items()})
        gdn, attn = hf_prefix + "linear_attn.", mg_prefix + "self_attention."
        out[attn + "in_proj_qkv.weight"] = group_by_key_head(hf[gdn + "in_proj_qkv.weight"], shape)
        out[attn + "conv_weight"] = group_by_key_head(hf[gdn + "conv1d.weight"][:, 0], shape)
        return out
    out.update({mg_prefix + m: hf[hf_prefix + h] for h, m in _ATTENTION.items()})
    attn = hf_prefix + "self_attn."
    projections = [hf[attn + f"{p}_proj.weight"] for p in "qkv"]
    out[mg_prefix + "self_attention.linear_qkv.weight"] = fuse_gated_qkv(*projections, shape)
    if shape.qkv_bias:
        biases = [hf[attn + f"{p}_proj.bias"] for p in "qkv"]
        out[mg_prefix + "self_attention.linear_qkv.bias"] = fuse_gated_qkv(*biases, shape)
    return out


def _layer_to_hf(
    mg: Tensors, mg_prefix: str, hf_prefix: str, shape: ModelShape, i: int | None
) -> dict:
    """Inverse of _layer_to_megatron."""
    out = {hf_prefix + h: mg[mg_prefix + m] for h, m in _COMMON.items()}
    out.update(decoder.mlp_to_hf(mg, mg_prefix + "mlp.", hf_prefix + "mlp."))
    attn = mg_prefix + "self_attention."
    if i is not None and shape.is_linear_attention_layer(i):
        out.update({hf_prefix + h: mg[mg_prefix + m] for h, m in _LINEAR.items()})
        gdn = hf_prefix + "linear_attn."
        out[gdn + "in_proj_qkv.weight"] = ungroup_by_key_head(
            mg[attn + "in_proj_qkv.weight"], shape
        )
        out[gdn + "conv1d.weight"] = ungroup_by_key_head(mg[attn + "conv_weight"], shape)[:, None]
        return out
    out.update({hf_prefix + h: mg[mg_prefix + m] for h, m in _ATTENTION.items()})
    names = [hf_prefix + f"self_attn.{p}_proj." for p in "qkv"]
    qkv = split_gated_qkv(mg[attn + "linear_qkv.weight"], shape)
    out.update({name + "weight": t for name, t in zip(names, qkv, strict=True)})
    if shape.qkv_bias:
        biases = split_gated_qkv(mg[attn + "linear_qkv.bias"], shape)
        out.update({name + "bias": t for name, t in zip(names, biases, strict=True)})
    return out


# HF suffix (under `mtp.`) -> Megatron suffix (under `mtp_layers.0.`) of the MTP layer's own
# tensors; its embedding and output layer are the trunk's.
_MTP_RENAMES = {
    "fc.weight": "input_proj.weight",  # input [normed embedding, normed hidden]
    "pre_fc_norm_embedding.weight": "token_layernorm.weight",
    "pre_fc_norm_hidden.weight": "hidden_layernorm.weight",
    "norm.weight": "final_layernorm.weight",
}


def _check_mtp_layers(shape: ModelShape) -> None:
    """Qwen3.5 keeps one input projection and final norm for all its MTP layers (vLLM's
    `Qwen3_5MultiTokenPredictor`), mtprun's draft heads one each: one layer maps."""
    if shape.mtp_layers > 1:
        raise ValueError(
            f"{shape.config_path or 'model.tiny'}: mtp_num_hidden_layers {shape.mtp_layers}; "
            "mtprun trains a Qwen3.5 MTP head of one layer (as released), not more"
        )


def _mtp_to_megatron(hf: Tensors, shape: ModelShape) -> dict:
    _check_mtp_layers(shape)
    out = {}
    for i in range(shape.mtp_layers):
        mg_prefix = f"mtp_layers.{i}."
        out.update({mg_prefix + m: hf["mtp." + h] for h, m in _MTP_RENAMES.items()})
        layer = _layer_to_megatron(
            hf, f"mtp.layers.{i}.", mg_prefix + "decoder_layer.", shape, None
        )
        out.update(layer)
    return out


def _mtp_to_hf(mg: Tensors, shape: ModelShape) -> dict:
    out = {}
    for i in range(shape.mtp_layers):
        mg_prefix = f"mtp_layers.{i}."
        out.update({"mtp." + h: mg[mg_prefix + m] for h, m in _MTP_RENAMES.items()})
        out.update(_layer_to_hf(mg, mg_prefix + "decoder_layer.", f"mtp.layers.{i}.", shape, None))
    return out


def _outside_layers(shape: ModelShape) -> dict[str, str]:
    prefix = text_prefix(shape)
    names = {
        prefix + "embed_tokens.weight": "embedding.word_embeddings.weight",
        prefix + "norm.weight": "decoder.final_layernorm.weight",
    }
    if not shape.tie_embeddings:
        names["lm_head.weight"] = "output_layer.weight"
    return names


def to_megatron(hf: Tensors, shape: ModelShape, experts: range) -> dict:
    """Embedding, decoder layers of both kinds, final norm and (untied) output layer (dense
    MLPs: no routed `experts`)."""
    out = {m: hf[h] for h, m in _outside_layers(shape).items()}
    prefix = text_prefix(shape)
    for i in range(shape.layers):
        out.update(_layer_to_megatron(hf, f"{prefix}layers.{i}.", f"decoder.layers.{i}.", shape, i))
    out.update(_mtp_to_megatron(hf, shape))
    return out


def to_hf(mg: Tensors, shape: ModelShape, part: range | None = None) -> dict:
    """Inverse of to_megatron, plus what conversion left out of the source checkpoint (its
    vision tower), carried through unchanged; with `part`, those decoder layers alone, and the
    rest with the first part (`decoder.part_layers`, `decoder.converts_outside`)."""
    prefix = text_prefix(shape)
    out = {}
    for i in decoder.part_layers(shape, part):
        out.update(_layer_to_hf(mg, f"decoder.layers.{i}.", f"{prefix}layers.{i}.", shape, i))
    if not decoder.converts_outside(part):
        return out
    out.update({h: mg[m] for h, m in _outside_layers(shape).items()})
    out.update(_mtp_to_hf(mg, shape))
    if shape.config_path is not None:
        out.update(carried_tensors(str(Path(shape.config_path).parent)))
    return out


@cache
def carried_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """The source folder's tensors that mtprun does not train, its vision tower (read once per
    process, those tensors alone)."""
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(VISION_PREFIX):
                    out[name] = weights.get_tensor(name)
    return out
