"""The Triton kernel of `mtprun.kernels.row_copies.sum_copies`: out[n] = sum_j y[slots[n, j]]
over the slots >= 0, in float32, rounded once to y's dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def sum_slots_kernel(y_ptr, slots_ptr, out_ptr, width, K: tl.constexpr, BLOCK: tl.constexpr):
    """Row n, columns [c BLOCK, (c+1) BLOCK) of out [N, width] from y [P, width]."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < width
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(slots_ptr + row * K + j)
        taken = inside & (col * 0 + slot >= 0)  # a block mask: the interpreter wants one
        total += tl.load(y_ptr + slot * width + col, mask=taken, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + col, total.to(out_ptr.dtype.element_ty), mask=inside)


def triton_sum_slots(y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [P, H], slots [N, K] int64 (-1: none) -> [N, H] in y's dtype."""
    y, slots = y.contiguous(), slots.contiguous()
    rows, k = slots.shape
    width = y.shape[1]
    out = y.new_empty(rows, width)
    if rows and width:
        block = min(_BLOCK, triton.next_power_of_2(width))
        sum_slots_kernel[(rows, triton.cdiv(width, block))](y, slots, out, width, K=k, BLOCK=block)
    return out
