"""bf16 training on CUDA through megatron-core's DistributedDataParallel and optimizer.

The policy's weights are bf16 (what the GPU computes with). Megatron-core's DDP gives every
parameter a float32 `main_grad` in one contiguous buffer; the linear layers' weight-gradient
GEMMs accumulate into it directly (`apex_standins`), the token embedding adds its micro batch's
rows into it (`embedding_grad`), the other parameters' bf16 gradients are added as soon as they
are produced. DDP sums the buffer over the data-parallel x
context-parallel ranks once per step (the trainer's losses are already weighted by each
share's tokens: `calculate_per_token_loss` makes DDP sum, not average), reduce-scattered so
that each rank keeps the slice it steps. Megatron-core's distributed optimizer keeps float32
master weights and the Adam state of that slice only (sharded over the data-parallel x
context-parallel ranks), clips by the whole model's norm (tensor-parallel duplicates and a
tied output-layer copy counted once, pipeline stages summed; the clip coefficient applied by
the AdamW kernel as it loads each gradient, `clip_in_step`) and all-gathers the stepped
slices back into the bf16 weights.

`trainer.optimizer_state: bfloat16` keeps AdamW's two moments in bfloat16 (4 bytes a parameter
instead of 8; Qwen3-8B at tp 2 holds 4.1B parameters a rank, whose float32 moments alone take
30.5 GiB of an 80 GB GPU). megatron-core's own way, its precision-aware optimizer, needs
Transformer Engine's FusedAdam; here the distributed optimizer's inner torch AdamW is replaced
by `AdamWBF16Moments` (the same update, one Triton launch a parameter, the moments rounded
stochastically: `mtprun.kernels.adamw`). Master weights and main gradients stay float32.

float32 recipes, CPUs (Megatron's optimizer needs CUDA) and a separately clipped MTP head
train with torch.optim on float32 weights instead (`mtprun.runner.trainer.optim`).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
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
        low_precision = trainer.optimizer == "adamw" and trainer.optimizer_state == "bfloat16"
        for shard in self._shards():
            if low_precision:
                _keep_moments_in_bf16(shard)
            else:
                _fuse_adam(shard.optimizer)
        inner = [shard.optimizer for shard in self._shards()]
        fold_clipping_into_step(o for o in inner if o is not None and _takes_a_divisor(o))
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
            # megatron-core's load gives every parameter one shared host `step`: one each,
            # on the parameter's device (the fused kernel reads it there) or, for
            # AdamWBF16Moments, on the host (no device read a parameter per step).
            host = isinstance(shard.optimizer, AdamWBF16Moments)
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
    """Per master slice of this rank: the weights ("param") and the Adam moments."""
    state = _inner_state(shard)
    return [
        {"param": p, **{k: v for k, v in state[p].items() if k != "step"}}
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


def _fuse_adam(optimizer: torch.optim.Optimizer) -> None:
    """Step a torch Adam(W) with its fused CUDA kernel (one launch per parameter group)
    instead of a foreach sweep per arithmetic op. Megatron-core builds torch.optim.AdamW
    without `fused` when neither Transformer Engine nor Apex is installed; torch reads the
    flag per group at every step, and the master weights it steps are float32 on the GPU."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        for group in optimizer.param_groups:
            group.update(fused=True, foreach=False)


def _takes_a_divisor(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s step divides each gradient by its `grad_scale` (clip_in_step)."""
    if isinstance(optimizer, AdamWBF16Moments):
        return True
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and fused


def _keep_moments_in_bf16(shard: Any) -> None:
    """Replace the distributed optimizer `shard`'s inner torch AdamW by AdamWBF16Moments on
    the same parameter groups (the float32 master shards), its state allocated now: megatron-
    core's checkpoint load allocates float32 moments for an optimizer without state."""
    inner = shard.optimizer
    if inner is None:  # a stub: no parameters on this rank
        return
    if not isinstance(inner, torch.optim.AdamW):
        raise TypeError(f"optimizer_state: bfloat16 needs AdamW, not {type(inner).__name__}")
    options = {k: inner.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    shard.optimizer = AdamWBF16Moments(inner.param_groups, **options)
    shard.optimizer.init_state()
    shard.init_state_fn = lambda optimizer, config=None: optimizer.init_state()


class AdamWBF16Moments(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay, bias correction, no amsgrad) with `exp_avg` and
    `exp_avg_sq` stored in bfloat16, each parameter stepped by `mtprun.kernels.adamw` (CUDA,
    or the Triton interpreter): float32 arithmetic, stochastic rounding into the moments.

    The rounding's random bits come from `seed` and the step count alone (and the values
    rounded), so replicated parameters stay equal on every rank. `step` is a host tensor per
    parameter, as torch's AdamW keeps it (megatron-core's checkpoints read it there). A loaded
    state keeps its moments in bfloat16 (torch's `load_state_dict` casts every state tensor to
    its parameter's dtype, float32 here)."""

    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.seed = seed

    def init_state(self) -> None:
        """Zero moments (bfloat16) and step 0 for every parameter that has no state yet."""
        for param in self._params():
            state = self.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in self.MOMENTS:
                    state[key] = torch.zeros_like(param, dtype=torch.bfloat16)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        from mtprun.kernels.adamw import adamw_step_  # Triton: imported where it runs

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.init_state()
        # torch's optimizers read a gradient divisor here (GradScaler's unscale, and the
        # clip coefficient: clip_in_step.py), a host tensor: no device read.
        divisor = getattr(self, "grad_scale", None)
        grad_scale = 1.0 if divisor is None else 1.0 / float(divisor)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("AdamWBF16Moments does not do amsgrad or maximize")
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                # Not in place: megatron-core's checkpoint load gives every parameter one
                # shared step tensor.
                state["step"] = state["step"] + 1
                step = int(state["step"])
                adamw_step_(
                    param,
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=step,
                    seed=hash((self.seed, step)),
                    grad_scale=grad_scale,
                )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["state"]
        moments = {i: {k: v for k, v in s.items() if k in self.MOMENTS} for i, s in saved.items()}
        rest = {i: {k: v for k, v in s.items() if k not in self.MOMENTS} for i, s in saved.items()}
        super().load_state_dict({**state_dict, "state": rest})
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for i, param in zip(ids, self._params(), strict=True):
            state = self.state[param]
            for key, value in moments.get(i, {}).items():
                state[key] = value.to(device=param.device, dtype=torch.bfloat16)
            if "step" in state:  # one host tensor each (a loaded state may share one)
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)

    def _params(self) -> Iterable[torch.Tensor]:
        return chain.from_iterable(g["params"] for g in self.param_groups)
