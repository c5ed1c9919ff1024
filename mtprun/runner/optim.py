"""torch.optim optimizer, learning-rate schedule and tensor-parallel-aware grad clipping.

Megatron's optimizer wrapper needs CUDA, so the trainer uses torch.optim on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtprun.models.tp_layout import split_of
from mtprun.spec.trainer import TrainerSection

NamedParams = list[tuple[str, torch.nn.Parameter]]


@dataclass
class OptimizedGroup:
    """Parameters stepped together: one optimizer, one lr schedule, one clipping norm."""

    name: str
    params: NamedParams
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self, max_norm: float | None, tp_group: dist.ProcessGroup | None) -> float:
        """Clip, step and advance the schedule; returns the norm before clipping."""
        norm = clip_grads(self.params, max_norm, tp_group)
        self.optimizer.step()
        self.scheduler.step()
        return norm


def build_groups(
    trainer: TrainerSection, model: torch.nn.Module, separate: dict[str, str] | None = None
) -> list[OptimizedGroup]:
    """The "policy" group of every trainable parameter, except that each name -> prefix of
    `separate` takes the parameters under that prefix into a group of its own (e.g.
    {"mtp": "mtp_layers."} gives the MTP head its own optimizer and clipping)."""
    separate = separate or {}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    taken = {n for n, _ in named for prefix in separate.values() if n.startswith(prefix)}
    parts = {"policy": [(n, p) for n, p in named if n not in taken]}
    for name, prefix in separate.items():
        parts[name] = [(n, p) for n, p in named if n.startswith(prefix)]
    groups = []
    for name, params in parts.items():
        optimizer = build_optimizer(trainer, params)
        groups.append(OptimizedGroup(name, params, optimizer, build_scheduler(trainer, optimizer)))
    return groups


def build_optimizer(trainer: TrainerSection, named_params: NamedParams) -> torch.optim.Optimizer:
    """AdamW or SGD; weight decay only on matrices (not on norms and biases)."""
    params = [p for _, p in named_params]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": trainer.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if trainer.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=trainer.lr)
    return torch.optim.SGD(groups, lr=trainer.lr)


def lr_factor(trainer: TrainerSection, step: int) -> float:
    """Multiplier of trainer.lr at optimizer step `step` (0-based): linear warm-up, then
    constant, linear or cosine decay to 0 at trainer.steps."""
    if step < trainer.warmup_steps:
        return (step + 1) / trainer.warmup_steps
    progress = min(
        1.0, (step - trainer.warmup_steps) / max(1, trainer.steps - trainer.warmup_steps)
    )
    if trainer.schedule == "linear":
        return 1.0 - progress
    if trainer.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def build_scheduler(
    trainer: TrainerSection, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(trainer, step))


def global_grad_norm(named_params: NamedParams, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """L2 norm of all gradients of the full (unsharded) model: squares of tensor-parallel
    shards are summed over the TP group, replicated tensors are counted once."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for name, p in named_params:
        if p.grad is None:
            continue
        square = p.grad.detach().double().pow(2).sum().cpu()
        if split_of(name) == "replicated":
            replicated += square
        else:
            sharded += square
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt()


def clip_grads(
    named_params: NamedParams,
    max_norm: float | None,
    tp_group: dist.ProcessGroup | None,
) -> float:
    """Clip to max_norm (None: measure only); returns the norm before clipping."""
    norm = global_grad_norm(named_params, tp_group)
    if max_norm is not None:
        params = [p for _, p in named_params]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.float())
    return float(norm)
