"""Which Megatron-core tensors each pipeline stage holds, under which names, and back.

Stage s of pp holds decoder layers [s * L/pp, (s + 1) * L/pp), numbered from 0 in its own
state dict (Megatron's layer modules are stage-local). The first stage also holds the input
embedding; the last holds the final norm, the output layer and the MTP layers. A tied model
keeps a copy of the embedding as the last stage's output layer: the trainer sums the two
copies' gradients over the embedding group, so they stay equal, and only the first stage's
copy is exported. A model with MTP layers also keeps the embedding on the last stage, where
the MTP layers look up the next tokens: it is that stage's tied output layer, or a frozen copy
the trainer refreshes from the first stage after every step; it is never exported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mtprun.models.shape import ModelShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# HF names: a decoder layer's (`model.layers.3.`, `model.language_model.layers.3.`), and the MTP
# layers' (MiMo's `model.mtp_layers.0.`, Qwen3.5's `mtp.`; GLM-4.5 numbers them after the trunk).
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HF_MTP = re.compile(r"(?:^|\.)mtp(?:_layers)?\.")
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"
_LAST_STAGE_PREFIXES = ("decoder.final_layernorm.", "output_layer.", "mtp_layers.")


@dataclass(frozen=True)
class PipelineStage:
    """Stage `rank` of `size`; `layers` is the model's decoder layer count."""

    rank: int
    size: int
    layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline stage {self.rank} is outside 0..{self.size - 1}")
        if self.layers % self.size:
            raise ValueError(
                f"parallel.pp={self.size} does not divide the model's {self.layers} decoder "
                "layers; choose a pp that divides num_hidden_layers"
            )

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers_per_stage(self) -> int:
        return self.layers // self.size

    @property
    def layer_offset(self) -> int:
        """Global index of this stage's first decoder layer."""
        return self.rank * self.layers_per_stage

    def holds_layer(self, index: int) -> bool:
        return self.layer_offset <= index < self.layer_offset + self.layers_per_stage


def stage_tensors(
    full: Mapping[str, torch.Tensor], shape: ModelShape, stage: PipelineStage
) -> dict[str, torch.Tensor]:
    """Whole-model Megatron tensors -> this stage's, under its local names."""
    out = {}
    for name, tensor in full.items():
        layer = _LAYER.match(name)
        if layer is not None:
            index = int(layer.group(1))
            if stage.holds_layer(index):
                out[f"decoder.layers.{index - stage.layer_offset}.{layer.group(2)}"] = tensor
        elif name == _EMBEDDING:
            if stage.first or holds_mtp_embedding(shape, stage):
                out[name] = tensor
            if is_tied_copy(_OUTPUT, shape, stage):
                out[_OUTPUT] = tensor
        elif name.startswith(_LAST_STAGE_PREFIXES):
            if stage.last:
                out[name] = tensor
        else:
            raise ValueError(f"no pipeline stage is known to hold {name!r}")
    return out


def layer_of(name: str) -> int | None:
    """The decoder layer of Megatron tensor `name` (stage-local under pipeline parallelism),
    None outside the decoder layers (embedding, final norm, output layer, MTP layers)."""
    layer = _LAYER.match(name)
    return None if layer is None else int(layer.group(1))


def hf_layer_of(name: str, shape: ModelShape) -> int | None:
    """The decoder layer the HF checkpoint tensor `name` belongs to: its index, `shape.layers`
    for any MTP layer's, None outside the layers (the embedding, final norm, output layer)."""
    if _HF_MTP.search(name):
        return shape.layers
    layer = _HF_LAYER.search(name)
    return None if layer is None else min(int(layer.group(1)), shape.layers)


def stage_reads(name: str, shape: ModelShape, stage: PipelineStage) -> bool:
    """Whether `stage` needs the HF checkpoint tensor `name` to convert its own tensors: its
    decoder layers', on the last stage the MTP layers', and every tensor outside the layers
    (which `stage_tensors` keeps or drops). A tensor wrongly left out here would reach the
    stage without data, which conversion refuses (`mtprun.models.convert`), never silently."""
    return stage_holds_hf_layer(hf_layer_of(name, shape), shape, stage)


def stage_holds_hf_layer(layer: int | None, shape: ModelShape, stage: PipelineStage) -> bool:
    """`stage_reads` for a tensor of `layer` (`hf_layer_of`'s index)."""
    if stage.size == 1 or layer is None:
        return True
    return stage.holds_layer(layer) if layer < shape.layers else stage.last


def global_tensors(
    local: Mapping[str, torch.Tensor], shape: ModelShape, stage: PipelineStage
) -> dict[str, torch.Tensor]:
    """This stage's tensors under whole-model names; copies of another stage's tensors (a
    tied output layer, the MTP layers' embedding) are left out."""
    out = {}
    for name, tensor in local.items():
        layer = _LAYER.match(name)
        if layer is not None:
            name = f"decoder.layers.{int(layer.group(1)) + stage.layer_offset}.{layer.group(2)}"
        elif is_tied_copy(name, shape, stage) or is_mtp_embedding_copy(name, shape, stage):
            continue
        out[name] = tensor
    return out


def splits_tied_embedding(shape: ModelShape, stage: PipelineStage) -> bool:
    """True when the model ties its output layer to the embedding and the stages hold the two
    apart (the first stage the embedding, the last its copy)."""
    return shape.tie_embeddings and stage.size > 1


def is_tied_copy(name: str, shape: ModelShape, stage: PipelineStage) -> bool:
    """True for the last stage's output layer when it copies the first stage's embedding."""
    return name == _OUTPUT and stage.last and splits_tied_embedding(shape, stage)


def holds_mtp_embedding(shape: ModelShape, stage: PipelineStage) -> bool:
    """True for a last stage that is not also the first and holds MTP layers: it keeps its own
    embedding for their next-token lookups."""
    return shape.mtp_layers > 0 and stage.last and not stage.first


def copies_mtp_embedding(shape: ModelShape, stage: PipelineStage) -> bool:
    """True when an untied model with MTP layers is split over stages: the last stage's
    embedding is a frozen copy of the first's, which the trainer refreshes after every step
    (a tied model's last stage uses its output layer, kept equal by summed gradients)."""
    return shape.mtp_layers > 0 and stage.size > 1 and not shape.tie_embeddings


def is_mtp_embedding_copy(name: str, shape: ModelShape, stage: PipelineStage) -> bool:
    """True for the last stage's embedding that only feeds the MTP layers."""
    return name == _EMBEDDING and holds_mtp_embedding(shape, stage)
