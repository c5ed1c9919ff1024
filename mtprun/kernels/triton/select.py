"""Policy-row selection on the GPU: one Triton launch and one device read.

The generic `row_groups` (mtprun.kernels.row_groups) issues ~30 small torch ops before the first
logits GEMM can be queued. At 3% active rows the whole step is a few milliseconds, and the
GPU idled while Python issued them (bench/triton_notes.md, v4). Here:

1. `select_rows_kernel`: each program takes a block of rows and writes one row of
   partials [P, 8] int64: the selected rows, the selected rows holding a NaN or inf, the
   min and max target, its first row outside the mask; program 0 adds the cu_seqlens checks
   (falls, first, last). It also compacts its selected rows in order, with their targets,
   sequence ids and hidden rows: it counts the selected rows before its block (the mask is
   a few KB, read from L2) to know where they go. Rows of the leading run of selected rows
   keep their index, so they are not copied (a full mask moves nothing).
2. The host reads the partials once; the compacted columns are then slices of the same
   allocation, and the compacted hidden a slice of its buffer, once the leading run is
   copied in (when some row is masked; a full mask uses the hidden as it is).

Used for plans without MTP heads (their draft rows pair rows t and t+k, which the generic
path selects) that compact the mask. Same checks and messages as `row_groups`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtprun.compiler import HeadPlan
from mtprun.kernels.inputs import HeadInputs
from mtprun.kernels.row_groups import RowGroup, check_finite_rows, check_values, policy_group

# One 16-row tile per program up to N = 16384 rows, four 1024-wide hidden tiles at H = 4096:
# the selection kernel sits between the host and the first GEMM, so it is sized for latency
# (a loop of 32 dependent tiles per program took 40 us on an H100, the GPU otherwise idle).
_BLOCK_R = 16  # rows per tile
_BLOCK_H = 1024  # hidden columns per tile
_BLOCK_S = 1024  # cu_seqlens entries per tile
_BLOCK_M = 8192  # mask entries per tile of the rank count (two dependent loads at N = 16384)
_MAX_PROGRAMS = 1024
_NUM_WARPS = 8
# Each program's row of partials.
_COLUMN_NAMES = (
    "count",
    "nonfinite",
    "targets_min",
    "targets_max",
    "cu_falls",
    "cu_first",
    "cu_last",
    "first_unselected",  # the first row of its block outside the mask, or N
)
_COLUMNS = len(_COLUMN_NAMES)
_PARTIALS_STRIDE = tl.constexpr(_COLUMNS)


@triton.jit
def select_rows_kernel(
    mask_ptr,
    targets_ptr,
    hidden_ptr,
    stride_hidden,
    cu_ptr,
    num_seqs,
    num_rows,
    hidden_size,
    search_steps,
    rows_per_program,
    out_ptr,
    student_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Rows [pid * rows_per_program, +rows_per_program): counts, finiteness, target range,
    and the compacted selected rows. `out` holds partials [P, 8] (P programs), then
    compact [3, num_rows]: each selected row's index, target and sequence id (the number of
    cu_seqlens[1:] entries <= row, by binary search in `search_steps` = bit length of the
    number of sequences) at its rank among all selected rows. `student` [num_rows, H] gets
    each selected row of hidden at its rank, except the leading run of selected rows (rank =
    row; the host copies them when it needs the compacted rows, and uses hidden itself when
    every row is selected, so a full mask writes nothing)."""
    pid = tl.program_id(0)
    compact_ptr = out_ptr + tl.num_programs(0) * _PARTIALS_STRIDE
    first = pid * rows_per_program
    stop = tl.minimum(first + rows_per_program, num_rows)
    cols = tl.arange(0, BLOCK_H)
    target_min = tl.load(targets_ptr + first)
    target_max = target_min
    before = 0  # selected rows before this block: the rank of its first selected row
    for block in range(0, first, BLOCK_M):
        seen = block + tl.arange(0, BLOCK_M)
        earlier = tl.load(mask_ptr + seen, mask=seen < first, other=0) != 0
        before += tl.sum(earlier.to(tl.int32), 0)
    count = 0
    nonfinite = 0
    first_unselected = num_rows
    for block in range(first, stop, BLOCK_R):
        rows = block + tl.arange(0, BLOCK_R)
        inside = rows < stop
        selected = tl.load(mask_ptr + rows, mask=inside, other=0) != 0
        targets = tl.load(targets_ptr + rows, mask=inside, other=0)
        target_min = tl.minimum(target_min, tl.min(tl.where(inside, targets, target_min), 0))
        target_max = tl.maximum(target_max, tl.max(tl.where(inside, targets, target_max), 0))
        low = tl.zeros((BLOCK_R,), dtype=tl.int32)
        high = tl.zeros((BLOCK_R,), dtype=tl.int32) + num_seqs
        for _ in range(search_steps):
            open_ = inside & (low < high)
            mid = (low + high) // 2
            bound = tl.load(cu_ptr + 1 + mid, mask=open_, other=0)
            right = bound <= rows
            low = tl.where(open_ & right, mid + 1, low)
            high = tl.where(open_ & ~right, mid, high)
        rank = before + count + tl.cumsum(selected.to(tl.int32), 0) - 1
        tl.store(compact_ptr + rank, rows.to(tl.int64), mask=selected)
        tl.store(compact_ptr + num_rows + rank, targets, mask=selected)
        tl.store(compact_ptr + 2 * num_rows + rank, low.to(tl.int64), mask=selected)
        count += tl.sum(selected.to(tl.int32), 0)
        unselected = tl.where(inside & ~selected, rows, num_rows)
        first_unselected = tl.minimum(first_unselected, tl.min(unselected, 0))
        moved = selected & (rank != rows)
        row_ptr = hidden_ptr + rows.to(tl.int64)[:, None] * stride_hidden
        student_row_ptr = student_ptr + rank.to(tl.int64)[:, None] * hidden_size
        bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
        for start in range(0, hidden_size, BLOCK_H):
            in_width = (start + cols < hidden_size)[None, :]
            x = tl.load(row_ptr + start + cols[None, :], mask=selected[:, None] & in_width)
            tl.store(student_row_ptr + start + cols[None, :], x, mask=moved[:, None] & in_width)
            x = x.to(tl.float32)
            nonfinite_value = (x != x) | (tl.abs(x) == float("inf"))
            bad = tl.maximum(bad, tl.max(nonfinite_value.to(tl.int32), 1))
        nonfinite += tl.sum(bad, 0)
    out = out_ptr + pid * _PARTIALS_STRIDE
    tl.store(out + 0, count.to(tl.int64))
    tl.store(out + 1, nonfinite.to(tl.int64))
    tl.store(out + 2, target_min.to(tl.int64))
    tl.store(out + 3, target_max.to(tl.int64))
    falls = 0
    cu_first = tl.zeros((), dtype=tl.int64)
    cu_last = tl.zeros((), dtype=tl.int64)
    if pid == 0:
        for block in range(0, num_seqs, BLOCK_S):
            seqs = block + tl.arange(0, BLOCK_S)
            inside = seqs < num_seqs
            low = tl.load(cu_ptr + seqs, mask=inside, other=0)
            high = tl.load(cu_ptr + seqs + 1, mask=inside, other=0)
            falls += tl.sum((high < low).to(tl.int32), 0)
        cu_first = tl.load(cu_ptr).to(tl.int64)
        cu_last = tl.load(cu_ptr + num_seqs).to(tl.int64)
    tl.store(out + 4, falls.to(tl.int64))
    tl.store(out + 5, cu_first)
    tl.store(out + 6, cu_last)
    tl.store(out + 7, first_unselected.to(tl.int64))


def selects_on_device(plan: HeadPlan, inputs: HeadInputs) -> bool:
    """Whether `select_policy_rows` handles this call (else use `row_groups`)."""
    unit_strides = (
        inputs.hidden.stride(1) == 1
        and inputs.loss_mask.stride(0) == 1
        and inputs.targets.stride(0) == 1
        and inputs.cu_seqlens.stride(0) == 1
    )
    return not plan.mtp_depths and plan.compact_mask and inputs.num_rows > 0 and unit_strides


def select_policy_rows(plan: HeadPlan, inputs: HeadInputs) -> tuple[RowGroup, torch.Tensor]:
    """The policy group of `row_groups` and its compacted [R, H] hidden rows."""
    n, hidden = inputs.num_rows, inputs.hidden
    rows_per_program = _BLOCK_R * triton.cdiv(triton.cdiv(n, _MAX_PROGRAMS), _BLOCK_R)
    programs = triton.cdiv(n, rows_per_program)
    # One allocation for both outputs, read and sliced without views in between: each CUDA
    # call here delays the first GEMM, and right after the read each costs 2-4x.
    out = torch.empty(programs * _COLUMNS + 3 * n, dtype=torch.int64, device=hidden.device)
    student = hidden.new_empty(hidden.shape)  # the compacted rows, written by the kernel
    num_seqs = inputs.cu_seqlens.shape[0] - 1
    select_rows_kernel[(programs,)](
        inputs.loss_mask,
        inputs.targets,
        hidden,
        hidden.stride(0),
        inputs.cu_seqlens,
        num_seqs,
        n,
        hidden.shape[1],
        num_seqs.bit_length(),
        rows_per_program,
        out,
        student,
        BLOCK_R=_BLOCK_R,
        BLOCK_H=_BLOCK_H,
        BLOCK_S=_BLOCK_S,
        BLOCK_M=_BLOCK_M,
        num_warps=_NUM_WARPS,
    )
    read = out[: programs * _COLUMNS].cpu().numpy().reshape(programs, _COLUMNS)  # one read
    column = {name: read[:, i] for i, name in enumerate(_COLUMN_NAMES)}
    check_values(
        {
            "targets_min": int(column["targets_min"].min()),
            "targets_max": int(column["targets_max"].max()),
            "cu_falls": int(column["cu_falls"][0]),
            "cu_first": int(column["cu_first"][0]),
            "cu_last": int(column["cu_last"][0]),
        },
        inputs,
    )
    count = int(column["count"].sum())
    compact = programs * _COLUMNS
    group = policy_group(
        plan,
        inputs,
        rows=out[compact : compact + count],
        valid=_all_true(count, hidden.device),
        seq_ids=out[compact + 2 * n : compact + 2 * n + count],
        targets=out[compact + n : compact + n + count],
    )
    if column["nonfinite"].any():
        check_finite_rows(group)
    if count == n:
        return group, hidden
    prefix = int(column["first_unselected"].min())  # leading selected rows, not moved
    if prefix:
        student[:prefix].copy_(hidden[:prefix])
    return group, student[:count]


_ALL_TRUE: dict[torch.device, torch.Tensor] = {}


def _all_true(count: int, device: torch.device) -> torch.Tensor:
    """[count] bool of True, a view of one cached buffer (a fill launch saved per call:
    compacted rows are all valid)."""
    cached = _ALL_TRUE.get(device)
    if cached is None or cached.shape[0] < count:
        cached = _ALL_TRUE[device] = torch.ones(
            max(count, 1 << 16), dtype=torch.bool, device=device
        )
    return cached[:count]
