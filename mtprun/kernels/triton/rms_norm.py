"""The Triton kernels of `mtprun.kernels.rms_norm` and their launches (formulas there).

A program holds a block of whole rows, [ROWS, BLOCK] with BLOCK >= H (`block_shape`). The
forward takes one block a program. The backward is persistent: a fixed number of programs
(a few per SM) stride over the blocks, each summing its rows' g x^ into a float32 [BLOCK]
register vector that it writes once to its row of the partials [programs, H].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ELEMENTS = 4096  # a program's block: rows x next_power_of_2(H) float32 values
_PROGRAMS_PER_SM = 4
_NUM_WARPS = 8  # 16 values a thread at a full block


def block_shape(width: int) -> tuple[int, int]:
    """(rows, columns) a program holds for rows of `width`: columns the next power of two,
    rows filling `_ELEMENTS` (so a per-head q/k norm of 128 takes 32 rows at once)."""
    columns = 1 << max(width - 1, 0).bit_length()
    return max(1, _ELEMENTS // columns), columns


@triton.jit
def rms_norm_forward_kernel(
    x_ptr, w_ptr, y_ptr, factor_ptr, rows, width, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    """y and r of rows [pid ROWS, (pid + 1) ROWS) of x [rows, width]."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    inside = (row < rows)[:, None] & (col < width)[None, :]
    offsets = row[:, None] * width + col[None, :]
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + col, mask=col < width, other=0.0).to(tl.float32)
    factor = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
    y = x * factor[:, None] * w[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(factor_ptr + row, factor, mask=row < rows)


@triton.jit
def rms_norm_backward_kernel(
    x_ptr, w_ptr, factor_ptr, g_ptr, dx_ptr, partial_ptr, rows, width,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dx of every block pid, pid + programs, ...; this program's sum of g x^ to partial[pid]."""
    pid = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + col, mask=col < width, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for first in range(pid * ROWS, rows, tl.num_programs(0) * ROWS):
        row = first + tl.arange(0, ROWS).to(tl.int64)
        inside = (row < rows)[:, None] & (col < width)[None, :]
        offsets = row[:, None] * width + col[None, :]
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        factor = tl.load(factor_ptr + row, mask=row < rows, other=0.0)
        normed = x * factor[:, None]
        gw = g * w[None, :]
        mean = tl.sum(gw * normed, axis=1) / width
        dx = (gw - normed * mean[:, None]) * factor[:, None]
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=inside)
        dw += tl.sum(g * normed, axis=0)
    tl.store(partial_ptr + pid * width + col, dw, mask=col < width)


def launch_forward(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, factors: torch.Tensor, eps: float
) -> None:
    """x, y [rows, H] contiguous, factors [rows] float32 (written)."""
    rows, width = x.shape
    per_block, block = block_shape(width)
    grid = (triton.cdiv(rows, per_block),)
    rms_norm_forward_kernel[grid](
        x, weight, y, factors, rows, width, eps,
        ROWS=per_block, BLOCK=block, num_warps=_NUM_WARPS,
    )  # fmt: skip


def launch_backward(
    x: torch.Tensor, weight: torch.Tensor, factors: torch.Tensor, grad: torch.Tensor,
    dx: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """dx [rows, H] (written); returns the weight gradient's float32 partials [programs, H]."""
    rows, width = x.shape
    per_block, block = block_shape(width)
    programs = triton.cdiv(rows, per_block)
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = min(programs, sms * _PROGRAMS_PER_SM)
    else:  # the interpreter: a few programs, so that each strides over several blocks
        programs = min(programs, 3)
    partials = torch.empty(programs, width, dtype=torch.float32, device=x.device)
    rms_norm_backward_kernel[(programs,)](
        x, weight, factors, grad, dx, partials, rows, width,
        ROWS=per_block, BLOCK=block, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return partials
