"""A colocated trainer's optimizer state and gradients on the host while the engines generate.

With `resources.placement: colocate` a rollout engine shares each trainer rank's GPU. While it
generates, the trainer needs nothing on the GPU but its bf16 weights (the sync reads them),
so the optimizer state (AdamW's moments, the float32 master weights of mixed precision) moves
to pinned host memory and the gradient buffers are released (every step zeroes them first).

Storages are emptied in place (`untyped_storage().resize_(0)`) and refilled at the same
tensors: every view of them (each parameter's `main_grad` in megatron's contiguous buffer, the
optimizer's references) stays valid without being found and rebound. The emptied memory goes
back to the driver (`torch.cuda.empty_cache`), where the engine's allocator can take it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class HostOffload:
    """`keep` tensors' storages move to the host and back; `drop` tensors' storages are
    released and come back zeroed."""

    def __init__(
        self,
        keep: Iterable[torch.Tensor],
        drop: Iterable[torch.Tensor],
        previous: HostOffload | None = None,
    ) -> None:
        """`previous`: an earlier offload of the same trainer, whose pinned host buffers are
        taken over when they fit (pinning gigabytes anew every step would cost seconds)."""
        self._drop = _cuda_storages(drop)
        dropped = {s.data_ptr() for s in self._drop}
        self._keep = [s for s in _cuda_storages(keep) if s.data_ptr() not in dropped]
        self._sizes = [s.nbytes() for s in (*self._keep, *self._drop)]
        self._host: list[torch.Tensor] = []  # pinned, allocated at the first offload
        if previous is not None and [h.numel() for h in previous._host] == [
            s.nbytes() for s in self._keep
        ]:
            self._host = previous._host
        self.on_host = False

    @property
    def nbytes(self) -> int:
        """The GPU bytes an offload frees."""
        return sum(self._sizes)

    def to_host(self) -> None:
        if self.on_host:
            return
        if not self._host:
            self._host = [
                torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=True) for s in self._keep
            ]
        for storage, host in zip(self._keep, self._host, strict=True):
            host.copy_(_bytes(storage), non_blocking=True)
        torch.cuda.synchronize()
        for storage in (*self._keep, *self._drop):
            storage.resize_(0)
        torch.cuda.empty_cache()
        self.on_host = True

    def to_device(self) -> None:
        if not self.on_host:
            return
        for storage, size in zip((*self._keep, *self._drop), self._sizes, strict=True):
            storage.resize_(size)
        for storage, host in zip(self._keep, self._host, strict=True):
            _bytes(storage).copy_(host, non_blocking=True)
        for storage in self._drop:
            _bytes(storage).zero_()
        torch.cuda.synchronize()
        self.on_host = False


def trainer_offload(trainer: Any, previous: HostOffload | None = None) -> HostOffload:
    """What a colocated `Trainer` sends to the host: every optimizer's state and master
    weights (never a model parameter itself), and the gradients (megatron's buffers, or the
    parameters' .grad)."""
    model_storages = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    keep: list[torch.Tensor] = []
    for optimizer in _torch_optimizers(trainer):
        for state in optimizer.state.values():
            keep += [t for t in state.values() if isinstance(t, torch.Tensor)]
        for group in optimizer.param_groups:
            keep += [
                p for p in group["params"] if p.untyped_storage().data_ptr() not in model_storages
            ]
    drop: list[torch.Tensor] = []
    if trainer.mixed is not None:
        ddp = trainer.mixed.ddp
        for buffer in (*ddp.buffers, *getattr(ddp, "expert_parallel_buffers", ())):
            drop.append(buffer.grad_data)
    else:
        drop += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    return HostOffload(keep, drop, previous)


def _torch_optimizers(trainer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers under the trainer's (megatron's wrap one each, chained or not)."""
    if trainer.mixed is None:
        return [group.optimizer for group in trainer.groups]
    outer = trainer.mixed.optimizer
    chained = getattr(outer, "chained_optimizers", None) or [outer]
    return [o.optimizer for o in chained]


def _cuda_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each CUDA storage behind `tensors` once, in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is None or not t.is_cuda:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
