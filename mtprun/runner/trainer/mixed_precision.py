"""bf16 training on CUDA through megatron-core's DistributedDataParallel and optimizer.

The policy's weights are bf16 (what the GPU computes with). Megatron-core's DDP gives every
parameter a float32 `main_grad` in one contiguous buffer; the linear layers' weight-gradient
GEMMs accumulate into it directly (`apex_standins`), the other parameters' bf16 gradients are
added as soon as they are produced. DDP sums the buffer over the data-parallel x
context-parallel ranks once per step (the trainer's losses are already weighted by each
share's tokens: `calculate_per_token_loss` makes DDP sum, not average), reduce-scattered so
that each rank keeps the slice it steps. Megatron-core's distributed optimizer keeps float32
master weights and the Adam state of that slice only (sharded over the data-parallel x
context-parallel ranks), clips by the whole model's norm (tensor-parallel duplicates and a
tied output-layer copy counted once, pipeline stages summed) and all-gathers the stepped
slices back into the bf16 weights.

float32 recipes, CPUs (Megatron's optimizer needs CUDA) and a separately clipped MTP head
train with torch.optim on float32 weights instead (`mtprun.runner.trainer.optim`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from mtprun.runner.trainer.apex_standins import (
    accumulate_wgrad_in_main_grad,
    use_foreach_multi_tensor_ops,
)
from mtprun.runner.trainer.optim import lr_factor
from mtprun.spec.trainer import TrainerSection


class MegatronMixedPrecision:
    """The policy's gradients and optimizer step under bf16 weights (see module docstring).

    `model` must already hold bf16 parameters; a parameter with requires_grad False (a frozen
    embedding copy) is left out of both the gradient buffer and the optimizer. The parameters
    named in `copies` (a tied output layer's copy on the last pipeline stage) are stepped
    but left out of the norm, which counts their original on the first stage.
    """

    def __init__(
        self, trainer: TrainerSection, model: torch.nn.Module, copies: frozenset[str] = frozenset()
    ) -> None:
        self.trainer = trainer
        for name, param in model.named_parameters():
            if name in copies:
                param.shared = True  # Megatron's norm skips `shared` parameters
        self.ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=True,
            ),
            module=model,
        )
        accumulate_wgrad_in_main_grad(model)  # after DDP: it gives each weight main_grad
        use_foreach_multi_tensor_ops()
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam" if trainer.optimizer == "adamw" else "sgd",
                lr=trainer.lr,
                weight_decay=trainer.weight_decay,
                adam_beta1=0.9,
                adam_beta2=0.999,
                adam_eps=1e-8,
                sgd_momentum=0.0,
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=True,
                # Megatron measures the norm only when it clips: no clipping is an
                # infinite bound, so grad_norm is still reported.
                clip_grad=trainer.grad_clip or float("inf"),
            ),
            [self.ddp],
        )
        for shard in self._shards():
            _fuse_adam(shard.optimizer)
        self.steps = 0

    @property
    def lr(self) -> float:
        return self.trainer.lr * lr_factor(self.trainer, self.steps)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def finish_grads(self) -> None:
        """Sum the float32 main gradients over the data-parallel x context-parallel ranks."""
        self.ddp.finish_grad_sync()

    def step(self) -> float:
        """Clip (trainer.grad_clip), step at this step's learning rate; returns the whole
        model's gradient norm before clipping."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        stepped, norm, _ = self.optimizer.step()
        if not stepped:  # bf16 has no loss scale: an inf/nan gradient is a diverged run
            raise FloatingPointError(
                f"step {self.steps}: the gradient holds inf or nan; lower trainer.lr or set "
                "trainer.grad_clip"
            )
        self.steps += 1
        return float(norm)

    def _shards(self) -> list[Any]:
        """The distributed optimizers inside get_megatron_optimizer's chain (one per
        parameter-group kind: dense, and expert parameters where there are any)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's settings, and its master weights and Adam state gathered from the
        data-parallel ranks on the first of them (None on the others). Every data-parallel
        rank must call it (it gathers)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "param_state": [shard.get_parameter_state_dp_zero() for shard in self._shards()],
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict: the first data-parallel rank's state is scattered to all
        (every data-parallel rank must call it)."""
        self.optimizer.load_state_dict(state["optimizer"])
        for shard, param_state in zip(self._shards(), state["param_state"], strict=True):
            # Without Apex/TE, megatron-core's load adds torch Adam's per-parameter `step`
            # (a CPU scalar) to the state, then copies every state key from the gathered
            # shards, which hold no `step`: set it aside, and back on the parameter's device
            # (where the fused kernel reads it).
            inner = shard.optimizer.state
            steps = {p: inner[p].pop("step") for p in list(inner) if "step" in inner[p]}
            shard.load_parameter_state_from_dp_zero(param_state)
            for param, step in steps.items():
                inner[param]["step"] = step.to(device=param.device, dtype=torch.float32)
        self.steps = int(state["steps"])


def _fuse_adam(optimizer: torch.optim.Optimizer) -> None:
    """Step a torch Adam(W) with its fused CUDA kernel (one launch per parameter group)
    instead of a foreach sweep per arithmetic op. Megatron-core builds torch.optim.AdamW
    without `fused` when neither Transformer Engine nor Apex is installed; torch reads the
    flag per group at every step, and the master weights it steps are float32 on the GPU."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        for group in optimizer.param_groups:
            group.update(fused=True, foreach=False)
