"""HF checkpoint tensors <-> Megatron-core tensors for every supported architecture.

hf_to_megatron gives one tensor- and expert-parallel rank's shards; megatron_to_hf takes full
tensors (gather them first: `tp_layout.gather_state_dict`, `ep_layout.gather_state_dict`). Each
family names the converter modules that together cover its tensors (`Family.converters`): the
shared decoder trunk (`mtprun.models.decoder`), for MoE families their sparse MLPs
(`mtprun.models.moe`), and its own in its folder (`mtprun.models.families.<name>`: MiMo's and
GLM-4.5's MTP layers, Qwen3.5's whole model).
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
    ones a rank does not keep (`reads` False) as data-less meta tensors of their shape, so that
    converting them costs no reads or copies (and the unused-tensor check still sees them)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        source: str,
        reads: Callable[[str], bool] | None = None,
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
        return tensor if self._reads is None or self._reads(name) else tensor.to("meta")

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _converters(shape: ModelShape) -> list[ModuleType]:
    """The converter modules of `shape`'s family, each with to_megatron and to_hf."""
    if shape.architecture is None:
        raise ValueError("the model's architecture is none mtprun supports")
    return [importlib.import_module(m) for m in family_of(shape.architecture).converters]


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
    keeps is read and copied: its routed experts, its stage's layers (`hf` may load lazily, as
    safetensors' memory-mapped files do).

    Every checkpoint tensor must be used: a leftover means the config and the weights disagree
    (a tied lm_head.weight that some checkpoints store anyway is the one exception, and the
    routed experts another expert-parallel rank holds).
    """
    shape.check_tp(tp_size)
    shape.check_ep(ep_size)
    held = ep_layout.held_experts(shape.experts.count if shape.experts else 0, ep_rank, ep_size)
    reads = None if stage is None else partial(pp_layout.stage_reads, shape=shape, stage=stage)
    tracked = _Tracked(hf, source, reads)
    full: dict[str, torch.Tensor] = {}
    for converter in _converters(shape):
        full.update(converter.to_megatron(tracked, shape, held))
    leftover = set(hf) - tracked.used - ({"lm_head.weight"} if shape.tie_embeddings else set())
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
    if stage is not None:
        full = pp_layout.stage_tensors(full, shape, stage)
        _check_materialized(full, stage)
    return tp_layout.shard_state_dict(full, tp_rank, tp_size)


def _check_materialized(
    tensors: Mapping[str, torch.Tensor], stage: pp_layout.PipelineStage
) -> None:
    """A stage's tensor converted from a checkpoint tensor `stage_reads` passed over (a family
    whose HF names it misreads) would load no weights: refuse it."""
    empty = [name for name, tensor in tensors.items() if tensor.is_meta]
    if empty:
        raise RuntimeError(
            f"pipeline stage {stage.rank}'s {empty[:3]} came from checkpoint tensors the stage "
            "did not read (pp_layout.stage_reads misnames this family's layers): a bug in "
            "mtprun, please report it"
        )


def _held_elsewhere(name: str, shape: ModelShape, held: range) -> bool:
    """Whether `name` is a routed expert's tensor that another expert-parallel rank converts."""
    expert = moe.expert_of(name)
    return (
        expert is not None
        and shape.experts is not None
        and (0 <= expert < shape.experts.count and expert not in held)
    )


def megatron_to_hf(mg: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Full (gathered) Megatron-named tensors -> HF-named tensors."""
    out: dict[str, torch.Tensor] = {}
    for converter in _converters(shape):
        out.update(converter.to_hf(mg, shape))
    return out
