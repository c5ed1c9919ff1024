"""Weights from a trainer rank to the rollout engine on its GPU through CUDA IPC.

Colocated placement (`resources.placement: colocate`) puts an engine on the GPU of a trainer
rank, where NCCL cannot connect the two (it refuses two ranks on one device). Instead the rank
packs the HF weights into a few large GPU buckets (the layout of `weight_transfer.plan_buckets`)
and hands out CUDA IPC handles of them: the engine maps the trainer's buckets into its own
address space and copies from them on the GPU, no host round trip. An engine on another GPU of
the host maps them as well (peer access), which is why a handle names its GPU by UUID: each Ray
actor sees its own `CUDA_VISIBLE_DEVICES`, so device indices differ between the two processes.

A sync goes a few layers at a time (`TrainerWorker.share_next_part`): the rank packs a part,
the engine copies it out (`RolloutEngine.load_ipc_part`) and feeds the copy to vLLM's in-place
reload, then the rank frees the part's buckets (`SharedWeights.release`) and packs the next.
So the GPU they share holds at most a part three times (gathered, packed, the engine's copy)
beside the two models, where a sync of the whole model held the whole model twice more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mtprun.runner.weight_transfer import (
    dtype_name,
    pack_bucket,
    plan_buckets,
    slots_by_bucket,
    unpack_buckets,
)

IPC_BUCKET_BYTES = 1 << 30  # few handles (each open costs a driver call), bounded copies


@dataclass
class WeightHandles:
    """What an engine needs to map the trainer's buckets: picklable (Ray passes it)."""

    layout: list[tuple[str, str, list[int]]]  # (name, dtype, shape) in bucket order
    bucket_bytes: int
    handles: list[tuple[Any, ...]]  # torch's rebuild_cuda_tensor arguments, one per bucket
    gpu_uuid: str  # the GPU that holds the buckets


class SharedWeights:
    """Trainer side: `weights` packed into GPU buckets and their IPC handles."""

    def __init__(self, weights: dict[str, torch.Tensor], bucket_bytes: int = IPC_BUCKET_BYTES):
        from torch.multiprocessing.reductions import reduce_tensor

        first = next(iter(weights.values()))
        if first.device.type != "cuda":
            raise ValueError(f"CUDA IPC shares GPU tensors; the weights are on {first.device}")
        layout, self.buckets = pack_weights(weights, bucket_bytes)
        torch.cuda.synchronize(first.device)  # the readers run on other processes' streams
        self.handles = WeightHandles(
            layout,
            bucket_bytes,
            # reduce_tensor -> (rebuild_cuda_tensor, args); the args are what travels.
            [reduce_tensor(bucket)[1] for bucket in self.buckets],
            gpu_uuid(first.device.index),
        )
        self.nbytes = sum(bucket.numel() for bucket in self.buckets)

    def release(self) -> None:
        """Free the buckets (every engine has loaded them)."""
        self.buckets = []
        # A bucket an engine had not closed yet when it was dropped waits in torch's IPC
        # limbo; this frees those closed since.
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def pack_weights(
    weights: dict[str, torch.Tensor], bucket_bytes: int = IPC_BUCKET_BYTES
) -> tuple[list[tuple[str, str, list[int]]], list[torch.Tensor]]:
    """`weights` packed into uint8 buckets on their device in `plan_buckets`' layout:
    (layout, buckets), what `SharedWeights` exports and `open_weights` unpacks."""
    layout = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in weights.items()]
    slots, sizes = plan_buckets(layout, bucket_bytes)
    held = slots_by_bucket(slots)
    device = next(iter(weights.values())).device
    buckets = [pack_bucket(weights, held.get(b, []), size, device) for b, size in enumerate(sizes)]
    return layout, buckets


def open_weights(shared: WeightHandles) -> list[tuple[str, torch.Tensor]]:
    """Engine side: the trainer's tensors as views into its mapped buckets (valid until the
    trainer releases them: copy what must outlive that)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = local_device_of(shared.gpu_uuid)
    buckets = []
    for args in shared.handles:
        args = list(args)
        args[6] = device  # storage_device: this process's index of the trainer's GPU
        buckets.append(rebuild_cuda_tensor(*args))
    slots, _ = plan_buckets(shared.layout, shared.bucket_bytes)
    return unpack_buckets(buckets, slots)


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_of(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; a clear error when it cannot see it."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    raise RuntimeError(
        f"CUDA IPC: the trainer's GPU {uuid} is not visible to this engine (CUDA_VISIBLE_DEVICES="
        f"{_visible()}); colocated engines must run on the trainer's host and see its GPU"
    )


def _visible() -> str:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
