"""Mixture-of-experts MLPs: HF tensors <-> mtprun's Megatron-core MoE layer, both ways.

Megatron side of a sparse layer i, under `decoder.layers.{i}.mlp.`:
- `router.weight` [E, H] (HF `mlp.gate.weight`), and with a score-correction bias (GLM-4.5)
  `router.expert_bias` [E] (HF `mlp.gate.e_score_correction_bias`);
- `experts.weight1` [E, 2 F, H]: expert e's [gate; up] rows, `experts.weight2` [E, H, F]: its
  down projection (`mtprun.runner.trainer.experts.GroupedExperts`; HF
  `mlp.experts.{e}.{gate,up,down}_proj.weight`). Expert parallelism splits both along E
  (`mtprun.models.ep_layout`): a rank converts the experts it holds and reads no other's
  weights (an expert-parallel rank of Qwen3-30B-A3B would otherwise stack all 128 experts of
  every layer, ep times the host memory and copies it keeps);
- a shared expert (GLM-4.5) as a dense MLP under `shared_experts.` (HF `mlp.shared_experts.`).
Dense layers (`ExpertShape.dense_layers`) are `mtprun.models.decoder`'s.
"""

from __future__ import annotations

import re

import torch

from mtprun.models import decoder
from mtprun.models.shape import ModelShape

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def expert_of(name: str) -> int | None:
    """The routed expert an HF tensor `name` belongs to (None: not a routed expert's)."""
    found = _EXPERT.search(name)
    return int(found.group(1)) if found else None


def _sparse_layers(shape: ModelShape) -> list[int]:
    return [i for i in range(shape.layers) if shape.is_moe_layer(i)]


def moe_to_megatron(
    hf: decoder.Tensors, hf_prefix: str, mg_prefix: str, shape: ModelShape, held: range
) -> dict:
    """One sparse MLP: HF tensors under `hf_prefix` (`...mlp.`) -> Megatron's under `mg_prefix`,
    the routed experts `held` only (the router and a shared expert whole)."""
    experts = shape.experts
    out = {mg_prefix + "router.weight": hf[hf_prefix + "gate.weight"]}
    if experts.score_bias:
        out[mg_prefix + "router.expert_bias"] = hf[hf_prefix + "gate.e_score_correction_bias"]
    weights = [[hf[f"{hf_prefix}experts.{e}.{p}.weight"] for p in _PROJECTIONS] for e in held]
    out[mg_prefix + "experts.weight1"] = torch.stack([torch.cat([g, u]) for g, u, _ in weights])
    out[mg_prefix + "experts.weight2"] = torch.stack([d for _, _, d in weights])
    if experts.shared_intermediate:
        out.update(
            decoder.mlp_to_megatron(
                hf, hf_prefix + "shared_experts.", mg_prefix + "shared_experts."
            )
        )
    return out


def moe_to_hf(mg: decoder.Tensors, mg_prefix: str, hf_prefix: str, shape: ModelShape) -> dict:
    """Inverse of moe_to_megatron (full tensors: every expert)."""
    experts = shape.experts
    out = {hf_prefix + "gate.weight": mg[mg_prefix + "router.weight"]}
    if experts.score_bias:
        out[hf_prefix + "gate.e_score_correction_bias"] = mg[mg_prefix + "router.expert_bias"]
    weight1, weight2 = mg[mg_prefix + "experts.weight1"], mg[mg_prefix + "experts.weight2"]
    for e in range(experts.count):
        gate, up = weight1[e].chunk(2)
        for name, tensor in zip(_PROJECTIONS, (gate, up, weight2[e]), strict=True):
            out[f"{hf_prefix}experts.{e}.{name}.weight"] = tensor.contiguous()
    if experts.shared_intermediate:
        out.update(
            decoder.mlp_to_hf(mg, mg_prefix + "shared_experts.", hf_prefix + "shared_experts.")
        )
    return out


def to_megatron(hf: decoder.Tensors, shape: ModelShape, experts: range) -> dict:
    """The sparse layers' MLPs with the routed `experts` a rank holds (the rest of the trunk is
    `decoder.to_megatron`'s)."""
    out = {}
    for i in _sparse_layers(shape):
        hf_prefix, mg_prefix = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        out.update(moe_to_megatron(hf, hf_prefix, mg_prefix, shape, experts))
    return out


def to_hf(mg: decoder.Tensors, shape: ModelShape, part: range | None = None) -> dict:
    """Inverse of to_megatron; with `part`, those layers' (`decoder.part_layers`) alone."""
    out = {}
    for i in (i for i in _sparse_layers(shape) if i in decoder.part_layers(shape, part)):
        out.update(moe_to_hf(mg, f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp.", shape))
    return out
