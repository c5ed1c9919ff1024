"""The checked inputs of the fused head loss and their active-row selection (backend-neutral).

`HeadInputs.build` checks every argument once; the torch engine and the Triton kernels both
take the result and call `row_groups`, so every backend rejects the same bad inputs with the
same messages and computes the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtprun.compiler import HeadPlan
from mtprun.losses import LossAgg, LossTerm

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


@dataclass(frozen=True)
class RowGroup:
    """Rows that share one student hidden tensor and one set of loss terms.

    The policy group holds the rows of `hidden` under the loss mask; MTP head k adds one group
    whose student rows t come from mtp_hidden[k-1] and whose teacher rows are t+k of `hidden`.

    rows:          [R] int64 indices into the N rows of `student`.
    valid:         [R] bool, False only for masked rows kept when the plan does not compact.
    seq_ids:       [R] int64 packed-sequence index of each row (for loss aggregation).
    targets:       [R] int64 global token id each row predicts.
    teacher_rows:  [R] int64 indices into `teacher` (the rows whose distribution teaches).
    head:          0 for the policy group, k for MTP head k.
    head_scale:    factor on the group's terms (1/D for an MTP head: mean over heads).
    trains_weight: whether the group's gradient reaches `weight`.
    """

    name: str
    terms: tuple[LossTerm, ...]
    student: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    seq_ids: torch.Tensor
    targets: torch.Tensor
    teacher: torch.Tensor | None = None
    teacher_weight: torch.Tensor | None = None
    teacher_rows: torch.Tensor | None = None
    teacher_temperature: float = 1.0
    head: int = 0
    head_scale: float = 1.0
    trains_weight: bool = True

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def row_groups(plan: HeadPlan, inputs: HeadInputs) -> list[RowGroup]:
    """The policy group and one group per MTP head, with masked rows dropped.

    Also checks the inputs' values: targets inside the vocabulary, cu_seqlens rising from 0
    to N, and finite hidden values in every row entering the loss (averaging a NaN into the
    loss would silently poison the step). The checks and the row counts are read from the
    device in one transfer: on a GPU each read stalls the host until the queued work is done,
    and reading them one by one left the GPU idle between Python steps.
    """
    n = inputs.num_rows
    mask, cu_seqlens = inputs.loss_mask, inputs.cu_seqlens
    # Only the MTP heads need the sequence ids before the counts (each op here is host time
    # before the first GEMM can be queued).
    seq_of_row = sequence_ids(cu_seqlens, n) if plan.mtp_depths else None
    draft_valid = [mtp_valid(mask, seq_of_row, k) for k in plan.mtp_depths]
    no_targets = inputs.targets.new_zeros(())
    targets_min, targets_max = torch.aminmax(inputs.targets) if n else (no_targets, no_targets)
    read = _read_at_once(
        targets_min=targets_min,
        targets_max=targets_max,
        cu_first=cu_seqlens[0],
        cu_last=cu_seqlens[-1],
        cu_falls=(cu_seqlens[1:] < cu_seqlens[:-1]).any(),
        policy_rows=mask.sum(),
        draft_rows=[valid.sum() for valid in draft_valid],
        selected_sums=[
            _selected_sum(student, selected)
            for student, selected in zip(
                (inputs.hidden, *inputs.mtp_hidden), (mask, *draft_valid), strict=True
            )
        ],
    )
    check_values(read, inputs)
    if seq_of_row is None:
        seq_of_row = sequence_ids(cu_seqlens, n)

    if plan.compact_mask:
        rows = _indices(mask, read["policy_rows"])
    else:
        rows = torch.arange(n, device=mask.device)
    groups = [
        policy_group(
            plan,
            inputs,
            rows=rows,
            valid=mask[rows],
            seq_ids=seq_of_row[rows],
            targets=inputs.targets[rows],
        )
    ]
    mtp = plan.term("mtp")
    for k, valid, count in zip(plan.mtp_depths, draft_valid, read["draft_rows"], strict=True):
        draft_rows = _indices(valid, count)
        groups.append(
            RowGroup(
                name=f"mtp/{k}",
                terms=(mtp,),
                student=inputs.mtp_hidden[k - 1],
                rows=draft_rows,
                valid=torch.ones_like(draft_rows, dtype=torch.bool),
                seq_ids=seq_of_row[draft_rows],
                targets=inputs.targets[draft_rows + k],
                teacher=inputs.hidden,
                teacher_weight=inputs.weight,
                teacher_rows=draft_rows + k,
                head=k,
                head_scale=1.0 / len(plan.mtp_depths),
                trains_weight=mtp.train_shared_output,
            )
        )
    for group, total in zip(groups, read["selected_sums"], strict=True):
        if not math.isfinite(total):  # a NaN/inf in a selected row, or only a huge sum?
            check_finite_rows(group)
    return groups


def policy_group(
    plan: HeadPlan,
    inputs: HeadInputs,
    *,
    rows: torch.Tensor,
    valid: torch.Tensor,
    seq_ids: torch.Tensor,
    targets: torch.Tensor,
) -> RowGroup:
    """The policy group over the selected `rows` of `hidden` (fields as in RowGroup)."""
    distill = plan.term("distill")
    return RowGroup(
        name="policy",
        terms=tuple(t for t in plan.terms if t.kind != "mtp"),
        student=inputs.hidden,
        rows=rows,
        valid=valid,
        seq_ids=seq_ids,
        targets=targets,
        teacher=inputs.teacher_hidden,
        teacher_weight=inputs.teacher_weight,
        teacher_rows=rows if distill is not None else None,
        teacher_temperature=distill.temperature if distill is not None else 1.0,
    )


def _read_at_once(**scalars: torch.Tensor | list[torch.Tensor]) -> dict:
    """The 0-d tensors (or lists of them) as Python numbers, read in one device transfer:
    stack promotes them to one dtype in the same kernel (float64 when a float64 is among
    them, exact for integers up to 2**53); integer and bool tensors come back as ints."""
    flat = [t for v in scalars.values() for t in (v if isinstance(v, list) else [v])]
    numbers = torch.stack(flat).tolist()
    values = iter(
        number if t.dtype.is_floating_point else int(number)
        for t, number in zip(flat, numbers, strict=True)
    )
    return {
        name: [next(values) for _ in v] if isinstance(v, list) else next(values)
        for name, v in scalars.items()
    }


def check_values(read: dict, inputs: HeadInputs) -> None:
    """Raise on targets outside the vocabulary or cu_seqlens not rising from 0 to N, given
    those values read from the device (targets_min/max, cu_first/last, cu_falls)."""
    n, vocab_size = inputs.num_rows, inputs.vocab_size
    if n and (read["targets_min"] < 0 or read["targets_max"] >= vocab_size):
        raise ValueError(
            f"targets must lie in [0, {vocab_size}) (the vocabulary size), "
            f"found values in [{read['targets_min']}, {read['targets_max']}]"
        )
    if read["cu_first"] != 0 or read["cu_last"] != n or read["cu_falls"]:
        raise _cu_seqlens_error(inputs.cu_seqlens, n)


def _indices(selected: torch.Tensor, count: int) -> torch.Tensor:
    """[count] positions of the True entries; `count` known, so the device is not asked."""
    return torch.nonzero_static(selected, size=count).squeeze(1)


def sequence_ids(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N] index of the packed sequence each row belongs to."""
    positions = torch.arange(num_rows, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def mtp_valid(loss_mask: torch.Tensor, seq_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """[N] bool: row t is valid for MTP head `depth` (t and t+depth in one sequence, both
    under the mask). The last `depth` rows never are."""
    valid = torch.zeros_like(loss_mask)
    if loss_mask.shape[0] > depth:
        valid[:-depth] = (
            loss_mask[:-depth] & loss_mask[depth:] & (seq_ids[:-depth] == seq_ids[depth:])
        )
    return valid


def aggregation_weights(
    loss_agg: LossAgg,
    group: RowGroup,
    cu_seqlens: torch.Tensor,
    norm_length: int | None = None,
    tokens_per_sequence: float | None = None,
) -> torch.Tensor:
    """[R] float32 weights w with sum(w * per_token_value) = the term's aggregated value.

    token-mean:              mean over the group's valid tokens.
    seq-mean-token-mean:     mean over sequences (those with a valid token) of their token mean.
    seq-mean-token-sum-norm: sum over those sequences of their token sum, divided by
                             (number of such sequences x L), L = norm_length (Dr. GRPO's
                             constant), or the longest sequence's length when None.
    With tokens_per_sequence (T / S of the whole step, whose calls the caller weighs by their
    share of its T trained tokens) the number of sequences is counted at the step's rate,
    valid tokens / tokens_per_sequence: the weighted calls then add up to the mean over the
    step's S sequences, whatever micro batch each sequence fell into.
    An empty group gets no weight (its terms contribute 0, never NaN).
    """
    valid = group.valid.float()
    if loss_agg == "token-mean":
        return valid / valid.sum().clamp(min=1)
    num_seqs = cu_seqlens.shape[0] - 1
    per_seq = torch.zeros(num_seqs, device=valid.device).index_add_(0, group.seq_ids, valid)
    if tokens_per_sequence is None:
        seqs_used = (per_seq > 0).sum().clamp(min=1)
    else:
        seqs_used = valid.sum().clamp(min=1) / tokens_per_sequence
    if loss_agg == "seq-mean-token-mean":
        return valid / (per_seq[group.seq_ids].clamp(min=1) * seqs_used)
    if norm_length is not None:
        return valid / (seqs_used * norm_length)
    longest = (cu_seqlens[1:] - cu_seqlens[:-1]).max().clamp(min=1)
    return valid / (seqs_used * longest)


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
    if cu_seqlens is None:
        return torch.tensor([0, n], dtype=torch.long, device=hidden.device)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D int tensor [S+1] of sequence boundaries")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    _check_device("cu_seqlens", cu_seqlens, hidden)
    bounds = cu_seqlens.long()
    if bounds.numel() < 2:
        raise _cu_seqlens_error(bounds, n)
    return bounds


def _cu_seqlens_error(bounds: torch.Tensor, n: int) -> ValueError:
    return ValueError(
        f"cu_seqlens must rise from 0 to N={n} (e.g. [0, len0, len0+len1, ..., {n}]), "
        f"got {bounds.tolist()[:8]}{' ...' if bounds.numel() > 8 else ''}"
    )


def _selected_sum(student: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """0-d float64: the sum of the selected rows' values. A NaN or inf in a selected row
    makes it non-finite; so can an overflow of finite values, which only sends the caller
    to the exact check. One read of `student` and three launches, where
    isfinite(student).all() made five full passes."""
    row_sums = student.sum(dim=1, dtype=torch.float32)
    return torch.where(selected, row_sums, 0.0).sum(dtype=torch.float64)


def check_finite_rows(group: RowGroup) -> None:
    """Raise, naming the first one, if a valid row of the group holds a NaN or inf."""
    finite_rows = torch.isfinite(group.student).all(dim=1)
    rows = group.rows[group.valid]
    bad = ~finite_rows[rows]
    if bool(bad.any()):
        source = "hidden" if group.name == "policy" else f"mtp_hidden[{group.head - 1}]"
        first = int(rows[bad][0])
        raise ValueError(
            f"{source} holds non-finite values (NaN/inf) in {int(bad.sum())} row(s) under the "
            f"loss mask, first at row {first}: fix the forward pass (or mask those rows out)"
        )
