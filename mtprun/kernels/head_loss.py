"""`head_loss`: the public entry point of the fused LM-head loss."""

from __future__ import annotations

import torch

from mtprun.kernels.inputs import HeadInputs
from mtprun.kernels.main_grad import grad_for_ddp_hook
from mtprun.kernels.output import HeadLossOutput
from mtprun.kernels.row_groups import row_groups
from mtprun.kernels.torch_engine import Chunking, Gradients, TorchHeadEngine


def head_loss(inputs: HeadInputs, *, chunking: Chunking | None = None) -> HeadLossOutput:
    """Every loss term of `inputs.plan` from one statistics pass over the vocab, without a
    [N, V] logits tensor.

    inputs:   checked once by `HeadInputs.build` (the arguments, their shapes and dtypes).
    chunking: row-chunk / vocab-tile sizes or memory budget of the torch engine.

    Shapes: hidden and each mtp_hidden [N, H], weight [V_local, H], per-row tensors [N].
    Shard bounds: with inputs.tp_group, `weight` holds global ids
    [vocab_start, vocab_start + V_local) (rank r of tp: [r V / tp, (r + 1) V / tp)) and
    targets are global ids. Collectives with tp_group: forward one all_gather of the packed
    per-row statistics of all groups; backward one all_reduce of grad_hidden and
    grad_mtp_hidden together (mtprun.kernels.tensor_parallel: pass hidden states that did not
    go through Megatron's copy_to_tensor_model_parallel_region).

    Returns loss (0-d float32, differentiable w.r.t. hidden, weight and mtp_hidden; with
    inputs.weight_main_grad the weight's gradient goes there instead, see HeadInputs.build), metrics
    (0-d float32 per name of plan.metrics) and logprobs ([N] float32, 0 where masked).
    CUDA tensors run the Triton kernels (`triton_head_loss`, `chunking` ignored).
    """
    if inputs.hidden.is_cuda:
        # Imported here: the Triton engine (its chunk loop and launches) loads only for CUDA.
        from mtprun.kernels.triton import triton_head_loss

        return triton_head_loss(inputs)
    plan = inputs.plan
    # A group of one exchanges nothing; without it the engine keeps the one-pass schedule.
    tp_group = inputs.tp_group if plan.tp_size > 1 else None
    groups = row_groups(plan, inputs)
    engine = TorchHeadEngine(plan, inputs, groups, chunking or Chunking(), tp_group)
    loss, logprobs, metrics = FusedHeadLoss.apply(
        engine, inputs.hidden, inputs.weight, *inputs.mtp_hidden
    )
    values = dict(zip(plan.metrics, metrics.unbind(), strict=True))
    return HeadLossOutput(loss=loss, metrics=values, logprobs=logprobs)


class FusedHeadLoss(torch.autograd.Function):
    """Autograd wrapper of `TorchHeadEngine`.

    forward(engine, hidden [N, H], weight [V_local, H], *mtp_hidden [N, H])
        -> loss (0-d), logprobs [N], metrics [M] (the last two not differentiable).
    Shard bounds and collectives: see `head_loss`. With the one-pass schedule the gradients
    are computed in forward and backward only scales them by grad_output; otherwise backward
    runs the gradient pass.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        engine: TorchHeadEngine,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        *mtp_hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wanted = ctx.needs_input_grad

        def accumulator(tensor: torch.Tensor, needed: bool) -> torch.Tensor | None:
            return torch.zeros(tensor.shape, device=tensor.device) if needed else None

        want = Gradients(
            hidden=accumulator(hidden, wanted[1]),
            weight=accumulator(weight, wanted[2]),
            mtp_hidden=[accumulator(h, w) for h, w in zip(mtp_hidden, wanted[3:], strict=True)],
        )
        result = engine.forward(want)
        ctx.engine = engine
        ctx.mark_non_differentiable(result.logprobs, result.metrics)
        return result.loss, result.logprobs, result.metrics

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss: torch.Tensor,
        _grad_logprobs: torch.Tensor,
        _grad_metrics: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        engine: TorchHeadEngine = ctx.engine
        grads = engine.backward(grad_loss)
        inputs = engine.inputs

        def cast(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
            return None if grad is None else grad.to(like.dtype)

        mtp = [cast(g, h) for g, h in zip(grads.mtp_hidden, inputs.mtp_hidden, strict=True)]
        weight_grad = None
        if inputs.weight_main_grad is not None and grads.weight is not None:
            # Already times grad_loss = weight_grad_scale (HeadInputs.build's contract).
            inputs.weight_main_grad.add_(grads.weight)
            weight_grad = grad_for_ddp_hook(inputs.weight)
        else:
            weight_grad = cast(grads.weight, inputs.weight)
        return None, cast(grads.hidden, inputs.hidden), weight_grad, *mtp
