"""How each Megatron-core tensor is split over tensor-parallel ranks, and back.

column: split along dim 0 (vocab rows of embedding/output, per-group q/k/v rows).
glu:    linear_fc1 holds [gate; up]; rank r holds [gate_r; up_r], not rows r of the stack.
row:    split along dim 1 (inputs of linear_proj, linear_fc2 and a GDN layer's out_proj).
Anything else (norms, the MTP input projection) is replicated on every rank.
LoRA adapters (`mtprun.models.lora`): a column-parallel layer's B is column, its A replicated;
a row-parallel layer's A is row, its B replicated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

Split = Literal["column", "glu", "row", "replicated"]

_COLUMN = (
    "word_embeddings.weight",
    "output_layer.weight",
    "linear_qkv.weight",
    "linear_qkv.bias",
    # Gated DeltaNet (`mtprun.models.families.qwen3_5.convert`): rows laid out per key head /
    # value head.
    "in_proj_qkv.weight",
    "conv_weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
    "A_log",
    "dt_bias",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")


def split_of(name: str) -> Split:
    if ".lora." in name:
        if name.endswith("lora_B") and ("linear_qkv." in name or "linear_fc1." in name):
            return "column"  # q/k/v and gate/up are separate adapters: plain row chunks
        if name.endswith("lora_A") and ("linear_proj." in name or "linear_fc2." in name):
            return "row"
        return "replicated"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith("linear_fc1.weight"):
        return "glu"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of the full (TP=1 layout) tensor `name`."""
    split = split_of(name)
    if tp == 1 or split == "replicated":
        return full
    if split == "column":
        return full.chunk(tp, dim=0)[rank].contiguous()
    if split == "row":
        return full.chunk(tp, dim=1)[rank].contiguous()
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).contiguous()


def unshard(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's part, in rank order (inverse of `shard`)."""
    split = split_of(name)
    if len(parts) == 1 or split == "replicated":
        return parts[0]
    if split == "column":
        return torch.cat(list(parts), dim=0)
    if split == "row":
        return torch.cat(list(parts), dim=1)
    gates, ups = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
    return torch.cat([*gates, *ups])


def gather_state_dict(
    local: Mapping[str, torch.Tensor],
    tp: int,
    group: torch.distributed.ProcessGroup | None,
    root_only: bool = False,
) -> dict:
    """Every rank's shards all-gathered over `group` and unsharded to full tensors (copies,
    never views of the live parameters). With `root_only` the shards go to the group's first
    rank alone (a gather): the others keep only their replicated tensors, so no full copy of
    a sharded tensor is ever built on them."""
    full = {}
    for name, t in local.items():
        whole = gather_tensor(name, t, tp, group, root_only)
        if whole is not None:
            full[name] = whole
    return full


def gather_tensor(
    name: str,
    t: torch.Tensor,
    tp: int,
    group: torch.distributed.ProcessGroup | None,
    root_only: bool = False,
) -> torch.Tensor | None:
    """Tensor `name`'s shards over `group` unsharded (a copy); with `root_only` None on all
    but the group's first rank for a sharded tensor. A collective over `group` when `name`
    is sharded."""
    if tp == 1 or split_of(name) == "replicated":
        return t.detach().clone()
    piece = t.detach().contiguous()
    root = not root_only or torch.distributed.get_rank(group) == 0
    parts = [torch.empty_like(t) for _ in range(tp)] if root else None
    if root_only:
        torch.distributed.gather(piece, parts, group=group, group_dst=0)
    else:
        torch.distributed.all_gather(parts, piece, group=group)
    return unshard(name, parts) if root else None


def full_meta(name: str, t: torch.Tensor, tp: int) -> torch.Tensor:
    """A data-less meta tensor of the full (unsharded) shape of rank shard `t`."""
    return unshard(name, [t.to("meta")] * tp)
