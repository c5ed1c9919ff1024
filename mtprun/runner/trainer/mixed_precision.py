"""bf16 training on CUDA through megatron-core's DistributedDataParallel and optimizer.

The policy's weights are bf16 (what the GPU computes with). Megatron-core's DDP gives every
parameter a float32 `main_grad` in one contiguous buffer; the linear layers' weight-gradient
GEMMs accumulate into it directly (`apex_standins`), the token embedding adds its micro batch's
rows into it (`embedding_grad`), the other parameters' bf16 gradients are added as soon as they
are produced. DDP sums the buffer over the data-parallel x
context-parallel ranks once per step (the trainer's losses are already weighted by each
share's tokens: `calculate_per_token_loss` makes DDP sum, not average), reduce-scattered so
that each rank keeps the slice it steps. The reduce-scatter overlaps the backward
(`overlap_grad_reduce`): a bucket's starts as soon as the last micro batch has handed DDP's
hook every one of its gradients (the backwards that add into main_grad themselves hand it a
dummy, `mtprun.kernels.main_grad`), and the earlier micro batches run under DDP's `no_sync`
(megatron-core's schedule reads it from the model config). Not where a tied embedding is split
over pipeline stages: the two stages' gradients are summed after the backward, before the
reduce. Megatron-core's distributed optimizer keeps float32
master weights and the Adam state of that slice only (sharded over the data-parallel x
context-parallel ranks), clips by the whole model's norm (tensor-parallel duplicates and a
tied output-layer copy counted once, pipeline stages summed; the clip coefficient applied by
the AdamW kernel as it loads each gradient, `clip_in_step`) and all-gathers the stepped
slices back into the bf16 weights.

The distributed optimizer's inner torch AdamW is replaced by `TritonAdamW` (`triton_adamw`):
the same update in one Triton launch a parameter, which writes the bf16 weights as it steps
the master slices. `trainer.optimizer_state: bfloat16` keeps its two moments in bfloat16 (4
bytes a parameter instead of 8; Qwen3-8B at tp 2 holds 4.1B parameters a rank, whose float32
moments alone take 30.5 GiB of an 80 GB GPU), rounded stochastically; megatron-core's own way,
its precision-aware optimizer, needs Transformer Engine's FusedAdam. Master weights and main
gradients stay float32.

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
from mtprun.runner.trainer.clip_in_step import fold_clipping_into_step
from mtprun.runner.trainer.embedding_grad import accumulate_embedding_grad_in_main_grad
from mtprun.runner.trainer.optim import lr_factor
from mtprun.runner.trainer.triton_adamw import TritonAdamW, step_model_weights_in_adamw
from mtprun.spec.trainer import TrainerSection


class MegatronMixedPrecision:
    """The policy's gradients and optimizer step under bf16 weights (see module docstring).

    `model` must already hold bf16 parameters; a parameter with requires_grad False (a frozen
    embedding copy) is left out of both the gradient buffer and the optimizer. The parameters
    named in `copies` (a tied output layer's copy on the last pipeline stage) are stepped
    but left out of the norm, which counts their original on the first stage.
    """

    def __init__(
        self,
        trainer: TrainerSection,
        model: torch.nn.Module,
        copies: frozenset[str] = frozenset(),
        overlap_grad_reduce: bool = True,
    ) -> None:
        self.trainer = trainer
        for name, param in model.named_parameters():
            if name in copies:
                param.shared = True  # Megatron's norm skips `shared` parameters
        self.ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=overlap_grad_reduce,
                use_distributed_optimizer=True,
            ),
            module=model,
        )
        if overlap_grad_reduce:
            model.config.no_sync_func = self.ddp.no_sync
        accumulate_wgrad_in_main_grad(model)  # after DDP: it gives each weight main_grad
        accumulate_embedding_grad_in_main_grad(model)
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
        if trainer.optimizer == "adamw":
            moments = getattr(torch, trainer.optimizer_state)
            for shard in self._shards():
                step_model_weights_in_adamw(shard, moments)
        inner = [shard.optimizer for shard in self._shards()]
        fold_clipping_into_step(o for o in inner if o is not None and _takes_a_divisor(o))
        self.steps = 0

    @property
    def lr(self) -> float:
        return self.trainer.lr * lr_factor(self.trainer, self.steps)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def finish_grads(self, backward_ran: bool = True) -> None:
        """Sum the float32 main gradients over the data-parallel x context-parallel ranks
        (`backward_ran` False: a step whose micro batches all had nothing to train, where no
        backward started the overlapped reduce)."""
        if self.ddp.ddp_config.overlap_grad_reduce and not backward_ran:
            self.ddp.start_grad_sync()
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
        """The optimizer's settings, and this rank's own slice of the float32 master weights
        and Adam state (`_local_state`), referenced, not copied: no rank gathers another's, so
        a checkpoint is resumed with the parallel layout it was written with."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "local_state": [_local_state(shard) for shard in self._shards()],
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict, on a rank of the same layout."""
        if "local_state" not in state:
            raise ValueError(
                "this checkpoint holds the optimizer state gathered on the first data-parallel "
                "rank, a format this mtprun no longer reads; resume it with the mtprun that "
                "wrote it, or start over"
            )
        self.optimizer.load_state_dict(state["optimizer"])  # allocates the inner state
        for shard, saved in zip(self._shards(), state["local_state"], strict=True):
            _load_local_state(shard, saved)
            # megatron-core's load gives every parameter one shared host `step`: one each, on
            # the host for TritonAdamW (no device read a parameter per step), else on the
            # parameter's device (where torch's optimizers read it).
            host = isinstance(shard.optimizer, TritonAdamW)
            for param, inner in _inner_state(shard).items():
                if "step" in inner:
                    device = "cpu" if host else param.device
                    inner["step"] = inner["step"].to(device, torch.float32, copy=True)
        self.steps = int(state["steps"])


def _master_params(shard: Any) -> list[torch.Tensor]:
    """The float32 master slices a distributed optimizer `shard` steps, in its order."""
    inner = shard.optimizer
    return [] if inner is None else [p for g in inner.param_groups for p in g["params"]]


def _inner_state(shard: Any) -> dict:
    """The torch optimizer state of a distributed optimizer `shard`, by master slice (none on a
    rank that owns no slice)."""
    return shard.optimizer.state if shard.optimizer is not None else {}


def _local_state(shard: Any) -> list[dict[str, torch.Tensor]]:
    """Per master slice of this rank: the weights ("param") and the Adam moments, as plain
    tensors on the same storage (a master parameter carries Python attributes, e.g. clipping's
    weak reference to its optimizer, which a checkpoint's pickle cannot hold)."""
    state = _inner_state(shard)
    return [
        {"param": p.detach(), **{k: v.detach() for k, v in state[p].items() if k != "step"}}
        for p in _master_params(shard)
    ]


@torch.no_grad()
def _load_local_state(shard: Any, saved: list[dict[str, torch.Tensor]]) -> None:
    """Copy `saved` (_local_state of a rank of the same layout) into `shard`'s tensors."""
    params = _master_params(shard)
    shapes = [p.numel() for p in params]
    if [s["param"].numel() for s in saved] != shapes:
        raise ValueError(
            "the checkpoint's optimizer slices do not match this rank's (another parallel "
            "layout or model): resume with the parallel settings the run was written with"
        )
    for param, tensors in zip(params, saved, strict=True):
        param.copy_(tensors["param"])
        for key, value in shard.optimizer.state[param].items():
            if key != "step":
                value.copy_(tensors[key])


def _takes_a_divisor(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s step divides each gradient by its `grad_scale` (clip_in_step)."""
    return isinstance(optimizer, TritonAdamW)
