"""The active rows of a head-loss call: the policy group and one group per MTP head, masked
rows dropped, with the value checks `HeadInputs.build` leaves to the device read (every
backend selects its rows here, or checks them with the same functions: triton/select.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mtprun.compiler import HeadPlan
from mtprun.kernels.inputs import HeadInputs, cu_seqlens_error
from mtprun.losses import LossAgg, LossTerm


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
        raise cu_seqlens_error(inputs.cu_seqlens, n)


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
