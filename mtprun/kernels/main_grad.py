"""`grad_for_ddp_hook`: what autograd gets for a weight whose gradient was added straight into
megatron-core's float32 `main_grad` (the experts' grouped GEMMs, the head loss's output layer,
the token embedding); `add_into_main_grad`: where such an add runs when a backward node runs on
a side stream.

megatron-core 0.16's contract for gradient-accumulation fusion
(`LinearWithGradAccumulationAndAsyncCommunication.backward`): DDP sets `grad_added_to_main_grad`
False on every parameter it wraps (and at each `zero_grad_buffer`); a backward that added the
gradient itself sets it True and hands autograd a dummy gradient (uninitialised; zeros when
the weight has `zero_out_wgrad`). DDP's backward hook then does not add it again, but it still
runs: with `overlap_grad_reduce` that hook marks the parameter ready and starts its bucket's
reduce-scatter once the bucket is complete (and asserts that a gradient came). Without DDP
(no `grad_added_to_main_grad`) autograd gets no gradient.

When a micro batch's halves run on two CUDA streams (`mtprun.runner.trainer.half_batches`),
both halves' backward nodes add into the same weights' main_grad. Those adds go to the default
stream, where DDP built the weights' gradient accumulators and so where autograd runs them and
DDP's hook starts a bucket's reduce: the adds never overlap one another, and a reduce starts
behind every add issued before it (autograd runs a weight's accumulator only once every node
that uses the weight has run). So one dummy a backward is enough: a weight used by both halves
hands it once (per autograd graph task), sparing autograd a weight-sized sum of two dummies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def add_into_main_grad(add: Callable[[], None], *reads: torch.Tensor) -> None:
    """Run `add` (an in-place add into a main_grad that reads `reads`) on the default stream
    when the current stream is another one (the module docstring says why), else as is."""
    if not reads[0].is_cuda:
        add()
        return
    current = torch.cuda.current_stream(reads[0].device)
    default = torch.cuda.default_stream(reads[0].device)
    if current == default:
        add()
        return
    default.wait_stream(current)
    with torch.cuda.stream(default):
        add()
    for tensor in reads:  # allocated on `current`: not reused before the add has read them
        tensor.record_stream(default)


def grad_for_ddp_hook(weight: torch.Tensor) -> torch.Tensor | None:
    """The dummy gradient DDP's hook expects once `weight`'s gradient is in its main_grad, or
    None where DDP does not watch `weight`. Contiguous like the weight, so that autograd keeps
    it rather than copying it; DDP's hook drops it at once."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    task = torch._C._current_graph_task_id()
    if task != -1 and getattr(weight, "dummy_grad_task", None) == task:
        return None  # this backward already handed the hook its dummy (module docstring)
    weight.dummy_grad_task = task
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight, memory_format=torch.contiguous_format)
    return torch.empty_like(weight, memory_format=torch.contiguous_format)
