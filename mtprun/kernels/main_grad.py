"""`grad_for_ddp_hook`: what autograd gets for a weight whose gradient was added straight into
megatron-core's float32 `main_grad` (the experts' grouped GEMMs, the head loss's output layer,
the token embedding).

megatron-core 0.16's contract for gradient-accumulation fusion
(`LinearWithGradAccumulationAndAsyncCommunication.backward`): DDP sets `grad_added_to_main_grad`
False on every parameter it wraps (and at each `zero_grad_buffer`); a backward that added the
gradient itself sets it True and hands autograd a dummy gradient (uninitialised; zeros when
the weight has `zero_out_wgrad`). DDP's backward hook then does not add it again, but it still
runs: with `overlap_grad_reduce` that hook marks the parameter ready and starts its bucket's
reduce-scatter once the bucket is complete (and asserts that a gradient came). Without DDP
(no `grad_added_to_main_grad`) autograd gets no gradient.
"""

from __future__ import annotations

import torch


def grad_for_ddp_hook(weight: torch.Tensor) -> torch.Tensor | None:
    """The dummy gradient DDP's hook expects once `weight`'s gradient is in its main_grad, or
    None where DDP does not watch `weight`. Contiguous like the weight, so that autograd keeps
    it rather than copying it; DDP's hook drops it at once."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight, memory_format=torch.contiguous_format)
    return torch.empty_like(weight, memory_format=torch.contiguous_format)
