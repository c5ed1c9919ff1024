"""Launching `head_rows_kernel` on one slice of a row group, with the TP exchange if any."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import triton

from mtprun.kernels.triton import rows as k
from mtprun.kernels.triton.groups import KernelGroup
from mtprun.kernels.triton.tensor_parallel import exchange_stats

# Measured on an H100 (bench --sweeps): 8192-wide tiles with 8 warps read/write the logits
# at 2.5 TB/s in the three passes, 4096/8 at 2.2 TB/s.
MAX_BLOCK_V = 8192
NUM_WARPS = 8


def run_rows(
    logits: torch.Tensor,
    group: KernelGroup,
    start: int,
    stop: int,
    *,
    vocab_offset: int,
    teacher: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    phase: Literal["all", "stats", "grad"] = "all",
) -> None:
    """Rows [start, stop) of `group`, whose logits are `logits` [stop - start, V_local]:
    statistics, values, and dz written over `logits` in place.

    phase "stats" only writes the statistics (over the whole vocab: exchanged under TP) and
    leaves the logits as they are; "grad" then reads them for the values and dz (a
    sequence-level ratio needs every row's statistics between the two)."""
    n_rows = stop - start
    if n_rows == 0:
        return
    terms = group.kernel_terms
    vocab_local = logits.shape[1]
    stats = group.stats[start:stop]
    # Pointers of disabled inputs are never read, but the compiler types what they would
    # load: float inputs get a float32 stand-in (an int64 one fails tl.exp at compile time).
    dummy, float_dummy = group.targets, stats
    teacher_arg = teacher if teacher is not None else logits
    args = (
        logits,
        logits.stride(0),
        teacher_arg,
        teacher_arg.stride(0),
        teacher_rows if teacher_rows is not None else dummy,
        1.0 / group.group.teacher_temperature,
        vocab_local,
        vocab_offset,
        group.targets[start:stop],
        stats,
        group.values[start:stop],
        group.weights[start:stop],
        group.token_inputs(start, stop, float_dummy),
        terms.params,
    )
    block = min(MAX_BLOCK_V, triton.next_power_of_2(vocab_local))
    constexprs = dict(
        ROWS=terms.rows,
        OPTIONS=terms.options,
        ROW_VALUES=k.ROW_VALUE_COLUMNS,
        TEACHER=terms.teacher,
        ARGMAX=terms.argmax,
        BLOCK_V=block,
        num_warps=NUM_WARPS if block >= 2048 else 4,
    )
    grid = (n_rows,)
    if tp_group is None and phase == "all":
        k.head_rows_kernel[grid](*args, MODE=k.FUSED.value, **constexprs)
        return
    if phase != "grad":
        k.head_rows_kernel[grid](*args, MODE=k.STATS.value, **constexprs)
        if tp_group is not None:
            stats.copy_(exchange_stats(stats, tp_group))
    if phase != "stats":
        k.head_rows_kernel[grid](*args, MODE=k.GRAD.value, **constexprs)
