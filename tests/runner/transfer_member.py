"""The receiving member of test_weight_transfer's two-process transfers, in a module of its
own: a spawned process imports the module of its target, and the test module's imports (its
conftest: transformers, the tiny models) cost the child ~6 CPU-s that it never uses."""

from __future__ import annotations

import weakref

import torch

from mtprun.runner.weight_transfer import TransferGroup


def member(port: int, out: str, generation: int = 1) -> None:
    """Member 1 of 2 of `generation`: save to `out` what the group's sender broadcasts (a
    copy of each tensor, the received one dropped at once, as an engine loading it does), and
    the most received buckets alive at once."""
    group = TransferGroup.join("127.0.0.1", port, generation=generation, rank=1, world_size=2)
    received, buckets, most = {}, [], 0
    for name, tensor in group.receive():
        buckets.append(weakref.ref(tensor.untyped_storage()))  # the bucket the view lies in
        received[name] = tensor.clone()
        del tensor
        alive = {id(bucket) for bucket in (ref() for ref in buckets) if bucket is not None}
        most = max(most, len(alive))
        del alive
    torch.save({"tensors": received, "most_buckets_alive": most}, out)
