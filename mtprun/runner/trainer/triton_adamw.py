"""The distributed optimizer's inner AdamW as one Triton launch a parameter (`TritonAdamW`),
which also writes the model's bf16 weights (`step_model_weights_in_adamw`).

megatron-core's distributed optimizer steps float32 master slices with a torch AdamW, then
copies every stepped slice into the bf16 weights the model computes with: for the
Qwen3-30B-A3B shape (3.1B parameters, one H100) torch's fused AdamW took 33.7 ms and the copy
6.4 ms of a 181 ms step, both bound by memory traffic. `mtprun.kernels.adamw` reads each
element of the master weight, gradient and moments once and writes the master weight, the
moments and the bf16 weight in the same pass: the copy's float32 read is gone, and so is the
write-back of each clipped gradient that torch's fused kernel makes (GradScaler's contract,
which the clip folded into the step, `clip_in_step`, would pay): 22.7 ms for the same step on
an H200 (4.1 TB/s, run 89). Moments in float32 (the default) or bfloat16
(`trainer.optimizer_state: bfloat16`, rounded stochastically: half their bytes).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay, bias correction, no amsgrad), each parameter
    stepped by `mtprun.kernels.adamw` (CUDA, or the Triton interpreter) with float32
    arithmetic, its moments stored in `moments_dtype`.

    bfloat16 moments are rounded stochastically, with random bits from `seed`, the step count
    and the values rounded alone, so replicated parameters stay equal on every rank. `step`
    is a host tensor per parameter, as torch's AdamW keeps it (megatron-core's checkpoints read
    it there). A loaded state keeps its moments in `moments_dtype` (torch's `load_state_dict`
    casts every state tensor to its parameter's dtype, float32 here). Where `model_weights` is
    set, each step also writes every parameter's updated value into the tensor that callable
    maps it to, and `wrote_model_weights` says so until the next copy reads it (see
    `step_model_weights_in_adamw`)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        moments_dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"moments are float32 or bfloat16, not {moments_dtype}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.moments_dtype = moments_dtype
        self.seed = seed
        self.model_weights: Callable[[], dict[torch.Tensor, torch.Tensor]] | None = None

    def init_state(self) -> None:
        """Zero moments and step 0 for every parameter that has no state yet."""
        for param in self._params():
            state = self.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in MOMENTS:
                    state[key] = torch.zeros_like(param, dtype=self.moments_dtype)

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
        copies = self.model_weights() if self.model_weights is not None else {}
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("TritonAdamW does not do amsgrad or maximize")
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
                    model_copy=copies.get(param),
                )
        self.wrote_model_weights = self.model_weights is not None
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["state"]
        moments = {i: {k: v for k, v in s.items() if k in MOMENTS} for i, s in saved.items()}
        rest = {i: {k: v for k, v in s.items() if k not in MOMENTS} for i, s in saved.items()}
        super().load_state_dict({**state_dict, "state": rest})
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for i, param in zip(ids, self._params(), strict=True):
            state = self.state[param]
            for key, value in moments.get(i, {}).items():
                state[key] = value.to(device=param.device, dtype=self.moments_dtype)
            if "step" in state:  # one host tensor each (a loaded state may share one)
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)

    def _params(self) -> Iterable[torch.Tensor]:
        return chain.from_iterable(g["params"] for g in self.param_groups)


def step_model_weights_in_adamw(shard: Any, moments_dtype: torch.dtype) -> None:
    """Make megatron-core's distributed optimizer `shard` step with TritonAdamW, which writes
    the bf16 model weights as it steps the float32 master slices.

    The inner torch AdamW is replaced on the same parameter groups, its state allocated now
    (megatron-core's checkpoint load allocates float32 moments for an optimizer without
    state). Each step the optimizer asks for the model slice of every master slice (the
    bucket's `param_data` range megatron-core's `_copy_main_params_to_model_params` copies
    into, looked up each step: offloading may move the buffers), and megatron-core's copy
    right after the step is skipped; a copy at any other time (a checkpoint load,
    `reload_model_params`) runs it."""
    inner = shard.optimizer
    if inner is None:  # a stub: no parameters on this rank
        return
    if not isinstance(inner, torch.optim.AdamW):
        raise TypeError(f"the Triton AdamW replaces AdamW, not {type(inner).__name__}")
    options = {k: inner.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    optimizer = TritonAdamW(inner.param_groups, **options, moments_dtype=moments_dtype)
    optimizer.init_state()
    # The shard holds the optimizer and the copy below: they reach the shard by a weak
    # reference, else the cycle keeps a dropped trainer's GPU memory until Python's collector
    # runs.
    owner = weakref.ref(shard)
    optimizer.model_weights = lambda: _model_slices(owner())
    shard.optimizer = optimizer
    shard.init_state_fn = lambda optimizer, config=None: optimizer.init_state()

    def copy_unless_stepped() -> None:
        this = owner()
        if not this.optimizer.__dict__.pop("wrote_model_weights", False):
            type(this)._copy_main_params_to_model_params(this)

    shard._copy_main_params_to_model_params = copy_unless_stepped


def _model_slices(shard: Any) -> dict[torch.Tensor, torch.Tensor]:
    """Master slice -> the range of the parameter buffer it is copied into after a step, for
    every model parameter of the distributed optimizer `shard` (megatron-core's
    `_copy_main_params_to_model_params`: a float32 model parameter's master slice is a view of
    that range, whose copy is then the same value written twice)."""
    slices = {}
    groups = chain(
        zip(shard.shard_fp32_from_float16_groups, shard.model_float16_groups, strict=True),
        zip(shard.shard_fp32_groups, shard.model_fp32_groups, strict=True),
    )
    for masters, params in groups:
        for master, param in zip(masters, params, strict=True):
            world = shard._get_model_param_range_map(param)["gbuf_world_in_bucket"]
            buffer_index, _, bucket = shard.model_param_gbuf_map[param]
            data = shard.buffers[buffer_index].buckets[bucket].param_data
            slices[master] = data.view(-1)[world.start : world.end]
    return slices
