"""`triton_head_loss`: the fused head loss on CUDA tensors (same contract as `head_loss`)."""

from __future__ import annotations

import torch

from mtprun import losses
from mtprun.compiler import HeadPlan
from mtprun.kernels.combine import sampler_metrics
from mtprun.kernels.inputs import HeadInputs
from mtprun.kernels.main_grad import grad_for_ddp_hook
from mtprun.kernels.output import HeadLossOutput
from mtprun.kernels.row_groups import row_groups
from mtprun.kernels.triton import groups as kg
from mtprun.kernels.triton import rows as k
from mtprun.kernels.triton.engine import DEFAULT_CHUNK_BYTES, run_chunks
from mtprun.kernels.triton.groups import KernelGroup
from mtprun.kernels.triton.scale import scale_
from mtprun.kernels.triton.select import select_policy_rows, selects_on_device


def triton_head_loss(
    inputs: HeadInputs, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> HeadLossOutput:
    """Every term of `inputs.plan` in one pass over the vocabulary, with Triton per-row
    kernels (contract, shard bounds and collectives: `mtprun.kernels.head_loss`).

    `chunk_bytes` bounds the logits buffers (the extra memory beyond the inputs and
    gradients). Gradients are computed in the forward pass when any input requires them.
    """
    plan, hidden, weight, tp_group = inputs.plan, inputs.hidden, inputs.weight, inputs.tp_group
    mtp = plan.term("mtp")
    if tp_group is not None and mtp is not None and mtp.target == "topk":
        raise NotImplementedError(
            "the Triton head loss does not run the MTP 'topk' target under tensor parallelism "
            "(the top-k spans the vocabulary shards): use target 'soft' or 'hard', or tp_size 1"
        )
    students = (hidden, *inputs.mtp_hidden)
    need_grads = [torch.is_grad_enabled() and s.requires_grad for s in students]
    need_weight_grad = torch.is_grad_enabled() and weight.requires_grad
    with torch.no_grad():  # the autograd graph is _PrecomputedGrads below, nothing else
        groups = _kernel_groups(plan, inputs)
        policy, drafts = groups[0], groups[1:]
        teacher_positions = [_teacher_positions(policy, d) for d in drafts]
        distill_teacher = inputs.teacher_hidden
        if distill_teacher is not None and distill_teacher.shape[0] != policy.num_rows:
            distill_teacher = distill_teacher[policy.group.rows]
        grads = run_chunks(
            policy,
            drafts,
            weight,
            teacher_hidden=distill_teacher,
            teacher_weight=inputs.teacher_weight,
            teacher_positions=teacher_positions,
            vocab_offset=inputs.vocab_start,
            need_grads=need_grads,
            need_weight_grad=need_weight_grad,
            chunk_bytes=chunk_bytes,
            tp_group=tp_group,
            weight_main_grad=inputs.weight_main_grad,
            weight_grad_scale=inputs.weight_grad_scale,
        )
        group_losses = [_group_loss(g) for g in groups]
        loss = sum(group_losses[1:], group_losses[0])
        metrics = _metrics(plan, policy, drafts, teacher_positions)
        logprobs = _logprobs(policy, hidden.shape[0])
        student_grads = tuple(
            _scatter_rows(grad, group.group.rows, hidden.shape[0])
            for grad, group in zip(grads.students, groups, strict=True)
        )
    loss = _PrecomputedGrads.apply(loss, (grads.weight, *student_grads), weight, *students)
    return HeadLossOutput(loss=loss, metrics=metrics, logprobs=logprobs)


class _PrecomputedGrads(torch.autograd.Function):
    """Returns `loss`; its backward hands out the gradients the forward already computed."""

    @staticmethod
    def forward(ctx, loss, grads, weight, *students):
        # weight and students are inputs only so that autograd routes their gradients here.
        ctx.grads = grads
        # No weight gradient with one wanted: the forward added it into the weight's main_grad.
        ctx.weight_in_main_grad = weight if grads[0] is None and weight.requires_grad else None
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.grads
        if grads is None:  # scaled in place below, so they serve one backward only
            raise RuntimeError(
                "head_loss backward ran twice on one forward: call head_loss again instead of "
                "backward(retain_graph=True)"
            )
        ctx.grads = None
        for grad in grads:
            if grad is not None:
                scale_(grad, grad_loss)
        weight_grad, *student_grads = grads
        if ctx.weight_in_main_grad is not None:
            weight_grad = grad_for_ddp_hook(ctx.weight_in_main_grad)
        return None, None, weight_grad, *student_grads


def _kernel_groups(plan: HeadPlan, inputs: HeadInputs) -> list[KernelGroup]:
    if selects_on_device(plan, inputs):
        group, student = select_policy_rows(plan, inputs)
        return [kg.build(group, inputs, argmax=False, student=student)]
    argmax = bool(plan.mtp_depths)
    return [kg.build(g, inputs, argmax=argmax) for g in row_groups(plan, inputs)]


def _teacher_positions(policy: KernelGroup, draft: KernelGroup) -> torch.Tensor:
    """Position of each draft row's teacher row among the policy rows."""
    n = policy.group.student.shape[0]
    position = torch.full((n,), -1, dtype=torch.long, device=policy.targets.device)
    position[policy.group.rows] = torch.arange(policy.num_rows, device=position.device)
    return position[draft.group.teacher_rows]


def _group_loss(group: KernelGroup) -> torch.Tensor:
    return (group.weights * group.per_token).sum()


def _metrics(
    plan: HeadPlan,
    policy: KernelGroup,
    drafts: list[KernelGroup],
    teacher_positions: list[torch.Tensor],
) -> dict[str, torch.Tensor]:
    # Each metric is one dot product over the rows (the step's tail of small launches runs
    # after the last gradient GEMM, on the critical path when few rows are active).
    mean_weights = policy.aggregation("token-mean")

    def token_mean(name: str) -> torch.Tensor:
        return torch.dot(policy.column(name), mean_weights)

    metrics = {}
    for term, call in zip(policy.group.terms, policy.calls, strict=True):
        value = policy.per_token[:, k.WEIGHT_COLUMNS.index(call.row.name)]
        metrics[term.kind] = torch.dot(policy.agg[term.kind], value)
        # The term's other metrics that its row function writes as values are token means.
        for name in losses.metric_names(term):
            if name != term.kind and name in call.row.values:
                metrics[name] = token_mean(name)
    metrics["entropy"] = token_mean("entropy")
    if policy.sampler_logprobs is not None:
        old, sampled = policy.old_logprobs, policy.sampler_logprobs
        metrics.update(sampler_metrics(policy.group, old, sampled, mean_weights))
    mtp = plan.term("mtp")
    if mtp is not None:
        head_values = []
        policy_argmax = policy.stats[:, k.STATS_COLUMNS.index("argmax")]
        for draft, positions in zip(drafts, teacher_positions, strict=True):
            head = draft.group.head
            (call,) = draft.calls
            value = draft.per_token[:, k.WEIGHT_COLUMNS.index(call.row.name)]
            head_values.append(torch.dot(draft.agg["mtp"], value))
            metrics[f"mtp/{head}/loss"] = head_values[-1]
            draft_argmax = draft.stats[:, k.STATS_COLUMNS.index("argmax")]
            teacher_argmax = policy_argmax[positions]
            agree = (draft_argmax == teacher_argmax).float()
            metrics[f"mtp/{head}/top1_agree"] = agree.sum() / max(draft.num_rows, 1)
        metrics["mtp"] = torch.stack(head_values).mean()
    return metrics


def _logprobs(policy: KernelGroup, n: int) -> torch.Tensor:
    logp = torch.where(policy.group.valid, policy.column("logp"), 0.0)
    out = torch.zeros(n, dtype=torch.float32, device=logp.device)
    return out.index_copy_(0, policy.group.rows, logp)


def _scatter_rows(grad: torch.Tensor | None, rows: torch.Tensor, n: int) -> torch.Tensor | None:
    # Allocated after the chunk loop has freed its logits buffers: allocating it before the
    # first GEMM (so the GPU zero-fills it while idle) gained nothing measurable at 3% and
    # raised the peak by [N, H] (run14, bench/triton_notes.md).
    if grad is None or grad.shape[0] == n:
        return grad
    return grad.new_zeros(n, grad.shape[1]).index_copy_(0, rows, grad)
