"""The checked inputs of the fused head loss (backend-neutral).

`HeadInputs.build` checks every argument once; the torch engine and the Triton kernels both
take the result and call `row_groups` (mtprun.kernels.row_groups), so every backend rejects
the same bad inputs with the same messages and computes the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtprun.compiler import HeadPlan

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class HeadInputs:
    """The checked inputs of one `head_loss` call: make them with `HeadInputs.build` (its
    docstring describes each argument).

    targets are int64 and cu_seqlens is given (one sequence when the caller passed none);
    mtp_hidden holds one tensor per MTP head of the plan; the teacher's tensors are detached.
    vocab_start / vocab_size: this rank's first global token id and the global vocabulary
    size (vocab_start = 0 and vocab_size = weight.shape[0] without tensor parallelism).
    """

    plan: HeadPlan
    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    advantages: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    sampler_logprobs: torch.Tensor | None
    mtp_hidden: tuple[torch.Tensor, ...]
    teacher_hidden: torch.Tensor | None
    teacher_weight: torch.Tensor | None
    tokens_per_sequence: float | None
    tp_group: dist.ProcessGroup | None
    vocab_start: int
    vocab_size: int
    weight_main_grad: torch.Tensor | None = None
    weight_grad_scale: float = 1.0

    @classmethod
    def build(
        cls,
        plan: HeadPlan,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        *,
        targets: torch.Tensor,
        loss_mask: torch.Tensor,
        advantages: torch.Tensor | None = None,
        old_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        sampler_logprobs: torch.Tensor | None = None,
        mtp_hidden: Sequence[torch.Tensor] | None = None,
        cu_seqlens: torch.Tensor | None = None,
        teacher_hidden: torch.Tensor | None = None,
        teacher_weight: torch.Tensor | None = None,
        tokens_per_sequence: float | None = None,
        tp_group: dist.ProcessGroup | None = None,
        weight_main_grad: torch.Tensor | None = None,
        weight_grad_scale: float = 1.0,
    ) -> HeadInputs:
        """Check the arguments of one head-loss call against `plan`; raise TypeError or
        ValueError naming the argument.

        plan:          the compiled terms (HeadPlan.from_losses([...])), for tp_group's size.
        hidden:        [N, H] final hidden states (float32 or bfloat16), row t predicts
                       targets[t].
        weight:        [V, H] output-layer weight; with tp_group this rank's vocab shard
                       [V / tp, H] (rank r holds global ids [r V / tp, (r + 1) V / tp)).
        targets:       [N] int global token ids, already shifted.
        loss_mask:     [N] bool; rows outside it are dropped before any vocab work.
        advantages, old_logprobs, ref_logprobs: [N] per token (grpo; old_logprobs None means
                       on-policy, ratio 1). The grpo term's variants (GSPO's sequence ratio,
                       CISPO, dual-clip, tis_cap) and their formulas: mtprun.losses.grpo.
        sampler_logprobs: [N] the rollout engine's log-probs of the targets when old_logprobs
                       were recomputed by the trainer (plans with sampler_logprobs or a grpo
                       tis_cap): the truncated IS weight min(exp(old - sampler), tis_cap) and
                       the metrics logprob_mismatch, is_weight_mean, is_clip_frac
                       (mtprun.losses.sampler).
        mtp_hidden:    D tensors [N, H]; head k at row t predicts targets[t + k], taught by
                       the policy's detached distribution at row t + k (same `weight`), valid
                       where t and t + k share a sequence of cu_seqlens and both are under the
                       mask.
        cu_seqlens:    [S + 1] int packed-sequence boundaries (default: one sequence).
        teacher_hidden, teacher_weight: [N, Ht] and [V, Ht] (its vocab shard under TP) of
                       the teacher for a `distill` term; never receive gradients.
        tokens_per_sequence: the trained tokens per trained sequence of the whole optimizer
                       step, when the caller weighs each call's loss by its share of the
                       step's trained tokens (the trainer does): the seq-mean-* aggregations
                       then average over the step's sequences, not this call's
                       (aggregation_weights).
        tp_group:      vocab-parallel process group (see mtprun.kernels.tensor_parallel for
                       the collectives and who all-reduces grad_hidden).
        weight_main_grad, weight_grad_scale: a float32 buffer shaped like `weight` (megatron-
                       core DDP's `main_grad` of the output layer) that takes the weight's
                       gradient times weight_grad_scale, added in float32 by each gradient
                       GEMM (no bf16 [V, H] gradient, no separate add); autograd then gets
                       none for `weight`. The caller must back-propagate the loss times exactly
                       weight_grad_scale (the trainer's micro-batch share), once.

        The checks of the tensors' values (targets inside the vocabulary, cu_seqlens rising
        from 0 to N, finite hidden values in the rows under the mask) are made by `head_loss`
        (`row_groups`), which reads them from the device together with its row counts.
        """
        tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        _check_plan(plan, tp_size)
        _check_matrix("hidden", hidden)
        _check_weight(weight, hidden)
        _check_vector("targets", targets, hidden)
        if targets.dtype.is_floating_point or targets.dtype == torch.bool:
            raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
        _check_vector("loss_mask", loss_mask, hidden)
        if loss_mask.dtype != torch.bool:
            raise TypeError(
                f"loss_mask must be a bool tensor, got {loss_mask.dtype}: pass mask.bool()"
            )
        per_token = {
            "advantages": advantages,
            "old_logprobs": old_logprobs,
            "ref_logprobs": ref_logprobs,
            "sampler_logprobs": sampler_logprobs,
        }
        _check_per_token(plan, per_token, hidden)
        if tokens_per_sequence is not None and not tokens_per_sequence > 0:
            raise ValueError(
                "tokens_per_sequence must be > 0 (the step's trained tokens per trained "
                f"sequence), got {tokens_per_sequence}"
            )
        vocab_size = tp_size * weight.shape[0]
        mtp = _check_mtp_hidden(plan, mtp_hidden, hidden, vocab_size)
        teacher_hidden, teacher_weight = _check_teacher(
            plan, teacher_hidden, teacher_weight, hidden, weight
        )
        cu_seqlens = _check_cu_seqlens(cu_seqlens, hidden)
        _check_main_grad(weight_main_grad, weight)
        return cls(
            plan=plan,
            hidden=hidden,
            weight=weight,
            targets=targets.long(),
            loss_mask=loss_mask,
            **per_token,
            cu_seqlens=cu_seqlens,
            mtp_hidden=mtp,
            teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight,
            tokens_per_sequence=tokens_per_sequence,
            tp_group=tp_group,
            vocab_start=tp_rank * weight.shape[0],
            vocab_size=vocab_size,
            weight_main_grad=weight_main_grad,
            weight_grad_scale=weight_grad_scale,
        )

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def norm_length(self) -> int | None:
        """The plan's constant of `seq-mean-token-sum-norm` (None: longest sequence)."""
        return self.plan.norm_length


def _check_plan(plan: HeadPlan, tp_size: int) -> None:
    if not isinstance(plan, HeadPlan):
        raise TypeError(f"plan must be a HeadPlan (HeadPlan.from_losses([...])), got {type(plan)}")
    if plan.tp_size != tp_size:
        raise ValueError(
            f"plan was compiled for tp_size={plan.tp_size} but tp_group has {tp_size} ranks; "
            "compile the plan with the tensor-parallel size you run with"
        )


def _check_tensor(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_device(name: str, value: torch.Tensor, hidden: torch.Tensor) -> None:
    if value.device != hidden.device:
        raise ValueError(f"{name} is on {value.device} but hidden is on {hidden.device}")


def _check_matrix(name: str, value: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
    """A 2-D floating tensor, on hidden's device when `hidden` is given."""
    _check_tensor(name, value)
    if value.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(value.shape)}")
    if value.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (float32 or bfloat16), got {value.dtype}"
        )
    if hidden is not None:
        _check_device(name, value, hidden)


def _check_weight(weight: torch.Tensor, hidden: torch.Tensor) -> None:
    _check_matrix("weight", weight, hidden)
    h = hidden.shape[1]
    if weight.shape[1] != h:
        raise ValueError(
            f"weight has hidden size {weight.shape[1]} but hidden has {h}: weight must be "
            f"[vocab, {h}] (the output layer's weight, not its transpose)"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")


def _check_main_grad(main_grad: torch.Tensor | None, weight: torch.Tensor) -> None:
    if main_grad is None:
        return
    _check_tensor("weight_main_grad", main_grad)
    if main_grad.shape != weight.shape or main_grad.dtype != torch.float32:
        raise ValueError(
            f"weight_main_grad must be float32 {tuple(weight.shape)} (weight's shape), got "
            f"{main_grad.dtype} {tuple(main_grad.shape)}"
        )
    _check_device("weight_main_grad", main_grad, weight)
    if not weight.requires_grad:
        raise ValueError("weight_main_grad is given but weight does not require a gradient")


def _check_vector(name: str, value: torch.Tensor, hidden: torch.Tensor) -> None:
    _check_tensor(name, value)
    if value.shape != hidden.shape[:1]:
        raise ValueError(
            f"{name} must have shape [{hidden.shape[0]}] (one entry per row of hidden), "
            f"got {tuple(value.shape)}"
        )
    _check_device(name, value, hidden)


def _check_per_token(
    plan: HeadPlan, values: dict[str, torch.Tensor | None], hidden: torch.Tensor
) -> None:
    """The optional [N] float arguments: each one the plan needs is given (sampler_logprobs
    only when the plan takes them), and each given one is a float vector like targets."""
    for name, error in _needed_per_token(plan).items():
        if values[name] is None:
            raise ValueError(error)
    if values["sampler_logprobs"] is not None and not plan.sampler_logprobs:
        raise ValueError(
            "sampler_logprobs was given but the plan does not take them: compile it with "
            "sampler_logprobs=True (or a grpo term with tis_cap)"
        )
    for name, value in values.items():
        if value is not None:
            _check_vector(name, value, hidden)
            if not value.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating tensor, got {value.dtype}")


def _needed_per_token(plan: HeadPlan) -> dict[str, str]:
    """The optional per-token arguments `plan` cannot run without, each with the error that
    its absence raises."""
    needed = {}
    grpo = plan.term("grpo")
    if grpo is not None:
        needed["advantages"] = (
            "the plan has a 'grpo' term: pass advantages=[N] per-token advantages"
        )
        if grpo.kl_coef > 0:
            needed["ref_logprobs"] = (
                f"the 'grpo' term has kl_coef={grpo.kl_coef}: pass ref_logprobs=[N] "
                "(reference-policy log-probs of the targets) or set kl_coef to 0"
            )
    if plan.sampler_logprobs:
        tis = grpo is not None and grpo.tis_cap is not None
        why = f"tis_cap={grpo.tis_cap}" if tis else "sampler_logprobs=True"
        needed["old_logprobs"] = needed["sampler_logprobs"] = (
            f"the plan has {why}: pass old_logprobs=[N] (recomputed by the trainer) and "
            "sampler_logprobs=[N] (the rollout engine's log-probs of the targets)"
        )
    return needed


def _check_mtp_hidden(
    plan: HeadPlan,
    mtp_hidden: Sequence[torch.Tensor] | None,
    hidden: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor, ...]:
    depth = len(plan.mtp_depths)
    if depth == 0:
        if mtp_hidden:
            raise ValueError("mtp_hidden was given but the plan has no 'mtp' term")
        return ()
    if mtp_hidden is None or isinstance(mtp_hidden, torch.Tensor):
        raise ValueError(
            f"the plan has an 'mtp' term of depth {depth}: pass mtp_hidden=[h_1, ..., h_{depth}], "
            "a list with one [N, H] hidden tensor per MTP head"
        )
    if len(mtp_hidden) != depth:
        raise ValueError(f"mtp_hidden has {len(mtp_hidden)} tensors but the mtp depth is {depth}")
    for k, head in enumerate(mtp_hidden, start=1):
        _check_matrix(f"mtp_hidden[{k - 1}]", head, hidden)
        if head.shape != hidden.shape or head.dtype != hidden.dtype:
            raise ValueError(
                f"mtp_hidden[{k - 1}] (head {k}) must match hidden: shape {tuple(hidden.shape)} "
                f"{hidden.dtype}, got {tuple(head.shape)} {head.dtype}"
            )
    topk = plan.term("mtp").topk
    if topk is not None and topk > vocab_size:
        raise ValueError(f"mtp topk={topk} exceeds the vocabulary size {vocab_size}")
    return tuple(mtp_hidden)


def _check_teacher(
    plan: HeadPlan,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if plan.term("distill") is None:
        if teacher_hidden is not None or teacher_weight is not None:
            raise ValueError(
                "teacher_hidden/teacher_weight were given but the plan has no 'distill'"
            )
        return None, None
    if teacher_hidden is None or teacher_weight is None:
        raise ValueError(
            "the plan has a 'distill' term: pass teacher_hidden=[N, Ht] (the teacher's final "
            "hidden states) and teacher_weight=[V, Ht] (the teacher's output layer)"
        )
    _check_matrix("teacher_hidden", teacher_hidden, hidden)
    _check_matrix("teacher_weight", teacher_weight, hidden)
    if teacher_hidden.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"teacher_hidden has {teacher_hidden.shape[0]} rows but hidden has {hidden.shape[0]}"
        )
    if teacher_weight.shape[1] != teacher_hidden.shape[1]:
        raise ValueError(
            f"teacher_weight has hidden size {teacher_weight.shape[1]} but teacher_hidden has "
            f"{teacher_hidden.shape[1]}"
        )
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"teacher_weight has {teacher_weight.shape[0]} vocab rows but weight has "
            f"{weight.shape[0]}: teacher and student must share the vocabulary (and its shards)"
        )
    return teacher_hidden.detach(), teacher_weight.detach()


def _check_cu_seqlens(cu_seqlens: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    n = hidden.shape[0]
    if cu_seqlens is None:  # [0, n] made where it is used: no host-to-GPU copy to wait on
        return torch.arange(2, dtype=torch.long, device=hidden.device) * n
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D int tensor [S+1] of sequence boundaries")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    _check_device("cu_seqlens", cu_seqlens, hidden)
    bounds = cu_seqlens.long()
    if bounds.numel() < 2:
        raise cu_seqlens_error(bounds, n)
    return bounds


def cu_seqlens_error(bounds: torch.Tensor, n: int) -> ValueError:
    return ValueError(
        f"cu_seqlens must rise from 0 to N={n} (e.g. [0, len0, len0+len1, ..., {n}]), "
        f"got {bounds.tolist()[:8]}{' ...' if bounds.numel() > 8 else ''}"
    )
