"""A trainer rank's tensors gathered into the whole model's (weight syncs, exports,
checkpoints' HF folders): over the tensor-parallel group, then the expert-parallel group,
renamed from the stage's layer numbers to the whole model's, then over pipeline stages; or,
for a weight sync's stream, a few decoder layers at a time (`whole_model_chunks`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mtprun.models import ModelShape, ep_layout, tp_layout
from mtprun.models.decoder import converts_outside
from mtprun.models.pp_layout import PipelineStage, global_tensors, layer_of
from mtprun.models.shape import LAYERS_PER_PART
from mtprun.models.tp_layout import gather_state_dict


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of `model`'s state dict (Transformer Engine's extra states left out)."""
    return {n: t for n, t in model.state_dict().items() if not n.endswith("_extra_state")}


def gather_whole_model(
    local: dict[str, torch.Tensor], shape: ModelShape, stage: PipelineStage, root_only: bool
) -> dict[str, torch.Tensor]:
    """This rank's tensors `local` -> whole-model tensors under whole-model names. Every rank
    gets them, or with `root_only` trainer rank 0 alone (the others {}): each group's parts
    then travel to its first rank only (rank 0's tensor-parallel and expert-parallel peers
    never hold a whole tensor of the model), and a pipeline group without rank 0 does not
    exchange them at all. A collective over this rank's TP, EP and pipeline groups.

    Under `root_only` only the first rank of each TP and EP group goes on to the stages'
    gather: rank 0's pipeline peers are such first ranks (Megatron's rank order puts the
    pipeline stage outermost, every other index 0), so each holds its stage's whole tensors."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    full = gather_state_dict(local, tp_size, tp_group, root_only)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep_group = parallel_state.get_expert_model_parallel_group() if ep_size > 1 else None
    if ep_size > 1:
        full = ep_layout.gather_state_dict(full, ep_size, ep_group, root_only)
    if root_only and (_not_first(tp_group, tp_size) or _not_first(ep_group, ep_size)):
        return {}  # its shards and experts sent to its groups' first ranks
    full = global_tensors(full, shape, stage)
    if stage.size > 1:
        full = _gather_stages(full, stage, root_only)
    if root_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return full


def _not_first(group: dist.ProcessGroup | None, size: int) -> bool:
    return size > 1 and dist.get_rank(group) != 0


def _gather_stages(
    full: dict[str, torch.Tensor], stage: PipelineStage, root_only: bool
) -> dict[str, torch.Tensor]:
    """Every stage's tensors (host copies) on every stage of this pipeline group, or with
    `root_only` on rank 0 alone."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if root_only and 0 not in dist.get_process_group_ranks(group):
        return {}
    mine = {name: t.cpu() for name, t in full.items()}
    parts: list[Any] = [None] * stage.size
    if not root_only:
        dist.all_gather_object(parts, mine, group=group)
    else:
        dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0, group=group)
        if dist.get_rank() != 0:
            return {}
    return {name: t for part in parts for name, t in part.items()}


def whole_model_chunks(
    local: dict[str, torch.Tensor],
    shape: ModelShape,
    stage: PipelineStage,
    root_only: bool,
    convert: Callable[..., dict[str, torch.Tensor]],
    layers: int = LAYERS_PER_PART,
) -> Iterator[dict[str, torch.Tensor]]:
    """`convert(gather_whole_model(...))` in parts of `layers` decoder layers, the tensors
    outside the layers with the first: `convert(tensors, part=range)` (as `megatron_to_hf`)
    converts a part's layers alone, and each tensor is gathered as the part's conversion reads
    it. Every rank of the gather must take every part (each is a collective); with
    `root_only` the others' parts are empty. Under pipeline parallelism the whole model is
    one part."""
    if stage.size > 1:
        full = gather_whole_model(local, shape, stage, root_only)
        yield convert(full) if full else {}
        return
    view = _GatheredOnRead(local, root_only)
    for first in range(0, shape.layers, layers):
        part = range(first, first + layers)
        view.read(part)
        yield {name: t for name, t in convert(view, part=part).items() if not t.is_meta}


class _GatheredOnRead(Mapping[str, torch.Tensor]):
    """One stage's tensors (pipeline size 1: the whole model's names) as whole tensors: a read
    of one in the layers being read gathers it over TP or EP (a collective where it is split:
    every rank of the gather reads the same names in the same order, as the same conversion
    runs on each), any other read (none, from a converter that keeps to its part) a
    data-less meta tensor of its whole shape. With `root_only` rank 0 alone gets data; the
    others send their parts and read meta tensors."""

    def __init__(self, local: dict[str, torch.Tensor], root_only: bool) -> None:
        self._local = local
        self._root_only = root_only
        self._holds = not root_only or not dist.is_initialized() or dist.get_rank() == 0
        self._tp = parallel_state.get_tensor_model_parallel_world_size()
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._ep = parallel_state.get_expert_model_parallel_world_size()
        self._ep_group = parallel_state.get_expert_model_parallel_group() if self._ep > 1 else None
        self._layers, self._outside = range(0), False
        self._read: dict[str, torch.Tensor] = {}

    def read(self, part: range) -> None:
        """From now on gather the tensors `part`'s conversion reads (`converts_outside`)."""
        self._layers, self._outside, self._read = part, converts_outside(part), {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._read:  # read twice by a converter: gathered once
            return self._read[name]
        local = self._local[name]
        layer = layer_of(name)
        if not (self._outside if layer is None else layer in self._layers):
            return self._whole_meta(name, local)
        whole = self._gather(name, local)
        self._read[name] = whole if whole is not None else self._whole_meta(name, local)
        return self._read[name]

    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor | None:
        if self._ep > 1 and ep_layout.is_expert(name):  # whole experts on a rank (etp = 1)
            return ep_layout.gather_experts(local, self._ep, self._ep_group, self._root_only)
        if self._tp > 1 and tp_layout.split_of(name) != "replicated":
            return tp_layout.gather_tensor(name, local, self._tp, self._tp_group, self._root_only)
        return local.detach().clone() if self._holds else None

    def _whole_meta(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if self._ep > 1 and ep_layout.is_expert(name):
            return torch.cat([local.to("meta")] * self._ep)
        return tp_layout.full_meta(name, local, self._tp)

    def __iter__(self) -> Iterator[str]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)
