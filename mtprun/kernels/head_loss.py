"""`head_loss`: the public entry point of the fused LM-head loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mtprun.compiler import HeadPlan
from mtprun.kernels.inputs import row_groups, validate
from mtprun.kernels.output import HeadLossOutput
from mtprun.kernels.torch_engine import Chunking, Gradients, TorchHeadEngine


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    plan: HeadPlan,
    *,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    mtp_hidden: Sequence[torch.Tensor] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    tokens_per_sequence: float | None = None,
    chunking: Chunking | None = None,
) -> HeadLossOutput:
    """Every loss term of `plan` from one statistics pass over the vocab, without a [N, V]
    logits tensor.

    hidden:        [N, H] final hidden states (float32 or bfloat16), row t predicts targets[t].
    weight:        [V, H] output-layer weight; with tp_group this rank's vocab shard
                   [V / tp, H] (rank r holds global ids [r V / tp, (r + 1) V / tp)).
    targets:       [N] int global token ids, already shifted.
    loss_mask:     [N] bool; rows outside it are dropped before any vocab work.
    advantages, old_logprobs, ref_logprobs: [N] per token (grpo; old_logprobs None means
                   on-policy, ratio 1). The grpo term's variants (GSPO's sequence ratio,
                   CISPO, dual-clip, tis_cap) and their formulas: mtprun.losses.grpo.
    mtp_hidden:    D tensors [N, H]; head k at row t predicts targets[t + k], taught by the
                   policy's detached distribution at row t + k (same `weight`), valid where
                   t and t + k share a sequence of cu_seqlens and both are under the mask.
    cu_seqlens:    [S + 1] int packed-sequence boundaries (default: one sequence).
    tp_group:      vocab-parallel process group (see mtprun.kernels.tensor_parallel for the
                   collectives and who all-reduces grad_hidden).
    teacher_hidden, teacher_weight: [N, Ht] and [V, Ht] (its vocab shard under TP) of the
                   teacher for a `distill` term; never receive gradients.
    sampler_logprobs: [N] the rollout engine's log-probs of the targets when old_logprobs
                   were recomputed by the trainer (plans with sampler_logprobs or a grpo
                   tis_cap): the truncated IS weight min(exp(old - sampler), tis_cap) and the
                   metrics logprob_mismatch, is_weight_mean, is_clip_frac (mtprun.losses.sampler).
    tokens_per_sequence: the trained tokens per trained sequence of the whole optimizer step,
                   when the caller weighs each call's loss by its share of the step's trained
                   tokens (the trainer does): the seq-mean-* aggregations then average over the
                   step's sequences, not this call's (inputs.aggregation_weights).
    chunking:      row-chunk / vocab-tile sizes or memory budget of the torch engine.

    Returns loss (0-d float32, differentiable w.r.t. hidden, weight and mtp_hidden), metrics
    (0-d float32 per name of plan.metrics) and logprobs ([N] float32, 0 where masked).
    CUDA tensors run the Triton kernels (same signature, `chunking` ignored).
    """
    arguments = {
        "targets": targets,
        "loss_mask": loss_mask,
        "advantages": advantages,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "mtp_hidden": mtp_hidden,
        "cu_seqlens": cu_seqlens,
        "teacher_hidden": teacher_hidden,
        "teacher_weight": teacher_weight,
        "sampler_logprobs": sampler_logprobs,
        "tokens_per_sequence": tokens_per_sequence,
    }
    if isinstance(hidden, torch.Tensor) and hidden.is_cuda:
        # Imported here so that CPU-only installs never import triton.
        from mtprun.kernels.triton import head_loss_triton

        return head_loss_triton(hidden, weight, plan, **arguments, tp_group=tp_group)
    tp_rank, tp_size = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
    inputs = validate(plan, hidden, weight, **arguments, tp_rank=tp_rank, tp_size=tp_size)
    if tp_size == 1:
        tp_group = None  # a group of one exchanges nothing; keep the one-pass schedule
    groups = row_groups(plan, inputs)
    engine = TorchHeadEngine(plan, inputs, groups, chunking or Chunking(), tp_group)
    loss, logprobs, metrics = FusedHeadLoss.apply(engine, hidden, weight, *inputs.mtp_hidden)
    values = dict(zip(plan.metrics, metrics.unbind(), strict=True))
    return HeadLossOutput(loss=loss, metrics=values, logprobs=logprobs)


class FusedHeadLoss(torch.autograd.Function):
    """Autograd wrapper of `TorchHeadEngine`.

    forward(engine, hidden [N, H], weight [V_local, H], *mtp_hidden [N, H])
        -> loss (0-d), logprobs [N], metrics [M] (the last two not differentiable).
    Shard bounds: `weight` holds global ids [vocab_start, vocab_start + V_local).
    Collectives with tp_group: forward one all_gather of the packed per-row statistics of
    all groups; backward one all_reduce of grad_hidden and grad_mtp_hidden together.
    With the one-pass schedule the gradients are computed in forward and backward only
    scales them by grad_output; otherwise backward runs the gradient pass.
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
        return None, cast(grads.hidden, inputs.hidden), cast(grads.weight, inputs.weight), *mtp
