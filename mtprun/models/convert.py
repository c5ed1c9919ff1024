"""HF checkpoint tensors <-> Megatron-core tensors for every supported architecture.

hf_to_megatron gives one tensor-, expert- and pipeline-parallel rank's shards, reading and
copying only those; megatron_to_hf takes full tensors (gather them first:
`tp_layout.gather_state_dict`, `ep_layout.gather_state_dict`). Each family names the converter
modules that together cover its tensors (`Family.converters`): the shared decoder trunk
(`mtprun.models.decoder`), for MoE families their sparse MLPs (`mtprun.models.moe`), and its own
in its folder (`mtprun.models.families.<name>`: MiMo's and GLM-4.5's MTP layers, Qwen3.5's whole
model).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from types import ModuleType

import torch

from mtprun.models import ep_layout, moe, pp_layout, tp_layout
from mtprun.models.families import family_of
from mtprun.models.shape import ModelShape


class _Tracked(Mapping[str, torch.Tensor]):
    """A read-only view that records which checkpoint tensors conversion used, and hands the
    ones this pass does not convert (`reads` False: another stage's layers, another pass's) as
    data-less meta tensors of their shape, so that converting them costs no reads or copies
    (and the unused-tensor check still sees them)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        source: str,
        reads: Callable[[str], bool],
    ) -> None:
        self._tensors = tensors
        self._source = source
        self._reads = reads
        self.used: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise KeyError(
                f"{self._source} has no tensor {name!r}; does config.json match the weights?"
            )
        self.used.add(name)
        tensor = self._tensors[name]
        return tensor if self._reads(name) else tensor.to("meta")

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _converters(shape: ModelShape) -> list[ModuleType]:
    """The converter modules of `shape`'s family, each with to_megatron and to_hf."""
    if shape.architecture is None:
        raise ValueError("the model's architecture is none mtprun supports")
    return [importlib.import_module(m) for m in family_of(shape.architecture).converters]


# Under tensor parallelism a rank converts this many layers' full tensors at a time and keeps
# their shards: its host copies peak at a few layers and its shards, not the whole model.
LAYERS_PER_PASS = 8


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: ModelShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    source: str = "the checkpoint",
    ep_rank: int = 0,
    ep_size: int = 1,
    stage: pp_layout.PipelineStage | None = None,
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> Megatron-named tensors of tensor-parallel rank `tp_rank` out of
    `tp_size`, expert-parallel rank `ep_rank` out of `ep_size` and pipeline `stage` (under its
    stage-local names, `pp_layout.stage_tensors`; None: the whole model). Only what the rank
    keeps is read and copied: its routed experts, its stage's layers, and under tensor
    parallelism `LAYERS_PER_PASS` layers' full tensors at a time (`hf` may load lazily, as
    safetensors' memory-mapped files do; the tensors a pass passes over go through the
    converters as data-less meta tensors).

    Every checkpoint tensor must be used: a leftover means the config and the weights disagree
    (a tied lm_head.weight that some checkpoints store anyway is the one exception, and the
    routed experts another expert-parallel rank holds).
    """
    shape.check_tp(tp_size)
    shape.check_ep(ep_size)
    held = ep_layout.held_experts(shape.experts.count if shape.experts else 0, ep_rank, ep_size)
    stage = stage or pp_layout.PipelineStage(0, 1, shape.layers)
    per_pass = LAYERS_PER_PASS if tp_size > 1 else shape.layers + 1
    converters = _converters(shape)
    out: dict[str, torch.Tensor] = {}
    kept: set[str] = set()
    for first in range(0, shape.layers + 1, per_pass):
        layers = range(first, first + per_pass)
        tracked = _Tracked(hf, source, partial(_reads, shape=shape, stage=stage, layers=layers))
        converted = {}
        for converter in converters:
            converted.update(converter.to_megatron(tracked, shape, held))
        if first == 0:
            _check_unused(hf, tracked.used, shape, held, source)
        local = pp_layout.stage_tensors(converted, shape, stage)
        kept.update(local)
        for name, tensor in local.items():
            if not tensor.is_meta:
                out[name] = tp_layout.shard(name, tensor, tp_rank, tp_size)
    _check_materialized(kept - out.keys(), stage)
    return out


def _reads(name: str, shape: ModelShape, stage: pp_layout.PipelineStage, layers: range) -> bool:
    """Whether the pass over `layers` reads HF tensor `name`: one of those layers' that `stage`
    holds (the tensors outside the layers in the first pass)."""
    layer = pp_layout.hf_layer_of(name, shape)
    in_pass = layers.start == 0 if layer is None else layer in layers
    return in_pass and pp_layout.stage_holds_hf_layer(layer, shape, stage)


def _check_unused(
    hf: Mapping[str, torch.Tensor], used: set[str], shape: ModelShape, held: range, source: str
) -> None:
    """ValueError for a checkpoint tensor no converter used (hf_to_megatron's docstring)."""
    leftover = set(hf) - used - ({"lm_head.weight"} if shape.tie_embeddings else set())
    leftover = {name for name in leftover if not _held_elsewhere(name, shape, held)}
    unconverted = family_of(shape.architecture).unconverted
    if unconverted is not None:
        leftover = {name for name in leftover if not unconverted(name, shape.layers)}
    if leftover:
        experts = f", {shape.experts.count} routed experts" if shape.experts else ""
        raise ValueError(
            f"{source} has tensors that {shape.architecture} with {shape.layers} layers"
            f"{experts} and {shape.mtp_layers} MTP layers (as config.json says) does not use: "
            f"{sorted(leftover)[:5]}; config.json and the weights disagree"
        )


def _check_materialized(empty: set[str], stage: pp_layout.PipelineStage) -> None:
    """A rank's tensor that only ever came out of conversion as a meta tensor (from checkpoint
    tensors `pp_layout.stage_reads` or `hf_layer_of` passed over: a family whose HF names they
    misread) would load no weights: refuse it."""
    if empty:
        raise RuntimeError(
            f"pipeline stage {stage.rank}'s {sorted(empty)[:3]} came from checkpoint tensors "
            "the stage did not read (pp_layout.hf_layer_of misnames this family's layers): a "
            "bug in mtprun, please report it"
        )


def _held_elsewhere(name: str, shape: ModelShape, held: range) -> bool:
    """Whether `name` is a routed expert's tensor that another expert-parallel rank converts."""
    expert = moe.expert_of(name)
    return (
        expert is not None
        and shape.experts is not None
        and (0 <= expert < shape.experts.count and expert not in held)
    )


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor], shape: ModelShape, part: range | None = None
) -> dict[str, torch.Tensor]:
    """Full (gathered) Megatron-named tensors -> HF-named tensors; with `part`, those decoder
    layers' alone (and the tensors outside the layers with the part that starts at 0): a
    conversion in parts reads only each part's tensors of `mg`."""
    out: dict[str, torch.Tensor] = {}
    for converter in _converters(shape):
        out.update(converter.to_hf(mg, shape, part))
    return out
