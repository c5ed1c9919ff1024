"""The receiving member of test_weight_transfer's two-process transfers, in a module of its
own: a spawned process imports the module of its target, and the test module's imports (its
conftest: transformers, the tiny models) cost the child ~6 CPU-s that it never uses."""

from __future__ import annotations

import torch

from mtprun.runner.weight_transfer import TransferGroup


def member(port: int, out: str, generation: int = 1) -> None:
    """Member 1 of 2 of `generation`: save what the group's sender broadcasts to `out`."""
    group = TransferGroup.join("127.0.0.1", port, generation=generation, rank=1, world_size=2)
    torch.save({name: t.clone() for name, t in group.receive()}, out)
