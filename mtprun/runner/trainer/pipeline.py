"""Micro batches through this process's pipeline stage, with Megatron-core's schedules.

With pp > 1 that is the 1F1B schedule: each stage runs its layers on a micro batch, sends
the [T, 1, H] float32 hidden states on (their shape first: packed micro batches differ in
length) and receives their gradient back, so every stage works on a different micro batch
at once. With pp = 1 it is a forward and a backward per micro batch. Every stage must call
`run_micro_batches` with the same items in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

Item = TypeVar("Item")
# The last stage's step returns (scalar to back-propagate, report); earlier stages' steps
# return the hidden states to send on.
StepResult = torch.Tensor | tuple[torch.Tensor, dict[str, Any]]


def run_micro_batches(
    model: torch.nn.Module,
    items: list[Item],
    step: Callable[[Item], StepResult],
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """Run `step` on every item through the pipeline (and back-propagate unless
    `forward_only`); returns each item's report on the last stage, [] on the others.

    `step(item)` runs this stage's part of the forward. On the last stage it returns the
    scalar whose gradient is wanted, already weighted as the caller wants it summed over the
    items, and a report of detached values; on the other stages, its output hidden states.
    """
    if not items:
        return []
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data: Iterator[Item], _model: torch.nn.Module):
        out = step(next(data))
        if isinstance(out, tuple):
            loss, report = out
            return loss, lambda loss: (loss, torch.ones((), dtype=torch.int), report)
        return out.float(), None  # the schedule sends pipeline_dtype (float32)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(items),
        model=model,
        num_microbatches=len(items),
        seq_length=1,  # unused: shapes are exchanged per micro batch (variable_seq_lengths)
        micro_batch_size=1,
        forward_only=forward_only,
    )
