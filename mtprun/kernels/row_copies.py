"""`copy_rows` / `sum_copies`: rows copied out to their destinations and summed back, each the
other's backward, with no atomic adds (the MoE token dispatcher's permute and unpermute).

A `RowCopies` plan maps N source rows to P destination rows, each source row to at most K
copies:
    sources [P] int64: the source row of destination row p;
    slots [N, K] int64: the destination rows of source row n, -1 where it has fewer than K.
Every destination row appears in `slots` exactly once (its source's row), so
    copy_rows(x [N, H]) = x[sources]                       [P, H]
    sum_copies(y [P, H])[n] = sum_j y[slots[n, j]]          [N, H], over j with slots >= 0
are adjoint: the gradient of copy_rows is sum_copies of the incoming gradient, and that of
sum_copies is copy_rows of it. Sums run in float32 and round once to the input's dtype, in
the fixed order j = 0 .. K-1, so the result does not depend on scheduling (torch's
index_add / scatter_add, which megatron-core's unpermute and its permute's backward use, add
the copies with atomics in bf16).

On CUDA `sum_copies` is one Triton launch (a program per row and column block reads the
row's K slots); elsewhere it pads y with a zero row, which the -1 slots index, and sums a
gather. Under TRITON_INTERPRET=1 the Triton path runs on CPU tensors (how tests check it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowCopies:
    """Where each of N source rows is copied among P destination rows (see the module doc)."""

    sources: torch.Tensor  # [P] int64
    slots: torch.Tensor  # [N, K] int64, -1: no copy


def copy_rows(x: torch.Tensor, plan: RowCopies) -> torch.Tensor:
    """x [N, H] -> x[plan.sources] [P, H]; backward: sum_copies of the gradient."""
    return _CopyRows.apply(x, plan)


def sum_copies(y: torch.Tensor, plan: RowCopies) -> torch.Tensor:
    """y [P, H] -> [N, H], row n the float32 sum of y[plan.slots[n]]; backward: copy_rows."""
    return _SumCopies.apply(y, plan)


class _CopyRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: RowCopies) -> torch.Tensor:
        ctx.plan = plan
        return x.index_select(0, plan.sources)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_slots(grad, ctx.plan.slots), None


class _SumCopies(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, plan: RowCopies) -> torch.Tensor:
        ctx.plan = plan
        return _sum_slots(y, plan.slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(0, ctx.plan.sources), None


def _sum_slots(y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    triton_runs = y.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if triton_runs and y.dtype != torch.float64:  # float64 (references) sums in float64
        from mtprun.kernels.triton.row_copies import triton_sum_slots  # Triton where it runs

        return triton_sum_slots(y, slots)
    padded = torch.cat([y, y.new_zeros(1, y.shape[1])])  # slot -1 reads the zero row
    accumulate = torch.float64 if y.dtype == torch.float64 else torch.float32
    return padded[slots].to(accumulate).sum(1).to(y.dtype)
