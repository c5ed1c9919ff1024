"""torch.optim optimizer, learning-rate schedule and grad clipping by the whole model's norm.

Megatron's optimizer wrapper needs CUDA, so the trainer uses torch.optim on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mtprun.models import ep_layout
from mtprun.models.tp_layout import split_of
from mtprun.spec.trainer import TrainerSection

NamedParams = list[tuple[str, torch.nn.Parameter]]


@dataclass(frozen=True)
class NormScope:
    """Where the pieces of the whole model's gradient norm live: tensor-parallel shards are
    summed over `tp`, the routed experts over `ep` (each rank holds some), pipeline stages over
    `pp` (None: this process alone), and the tensors named in `copies` are counted on another
    stage (a tied output layer's copy)."""

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    copies: frozenset[str] = frozenset()


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

    def step(self, max_norm: float | None, scope: NormScope) -> float:
        """Clip, step and advance the schedule; returns the norm before clipping."""
        norm = clip_grads(self.params, max_norm, scope)
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


def load_optimizer_state(name: str, optimizer: Any, state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, where torch's refusal of a state saved for other
    parameters says what in the recipe may have changed."""
    try:
        optimizer.load_state_dict(state)
    except ValueError as err:
        if "parameter group" not in str(err):
            raise
        raise ValueError(
            f"the checkpoint's {name!r} optimizer holds state for other trainable parameters "
            f"than this recipe trains ({err}): were the model, model.lora or the mtp terms "
            "changed? (an MTP layer that no mtp term trains is frozen; checkpoints written "
            "before mtprun froze them hold its state). Resume with the recipe that wrote the "
            "checkpoint, or start a new run from its exported weights"
        ) from err


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


def global_grad_norm(named_params: NamedParams, scope: NormScope) -> torch.Tensor:
    """L2 norm of all gradients of the full (unsharded, unsplit) model: squares of
    tensor-parallel shards are summed over the TP group, those of the routed experts over the
    expert-parallel group, replicated tensors are counted once, and the stages' sums are added
    over the pipeline group."""
    # On the parameters' device: NCCL reduces device tensors only.
    device = named_params[0][1].device if named_params else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in named_params:
        if p.grad is None or name in scope.copies:
            continue
        square = p.grad.detach().double().pow(2).sum()
        if scope.ep is not None and ep_layout.is_expert(name):
            experts += square
        elif split_of(name) == "replicated":
            replicated += square
        else:
            sharded += square
    _sum_over(sharded, scope.tp)
    _sum_over(experts, scope.ep)
    total = sharded + replicated + experts
    _sum_over(total, scope.pp)
    return total.sqrt()


def _sum_over(value: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)


def clip_grads(named_params: NamedParams, max_norm: float | None, scope: NormScope) -> float:
    """Clip to max_norm (None: measure only); returns the norm before clipping."""
    norm = global_grad_norm(named_params, scope)
    if max_norm is not None:
        params = [p for _, p in named_params]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.float())
    return float(norm)
