"""A trainer rank's tensors gathered into the whole model's (weight syncs, exports,
checkpoints' HF folders): over the tensor-parallel group, then the expert-parallel group,
renamed from the stage's layer numbers to the whole model's, then over pipeline stages."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mtprun.models import ModelShape, ep_layout
from mtprun.models.pp_layout import PipelineStage, global_tensors
from mtprun.models.tp_layout import gather_state_dict


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
