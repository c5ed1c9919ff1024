"""megatron-core DDP's backward hook on one parameter, registered as DDP registers it (on the
parameter's gradient accumulator), for the tests of the backwards that add a weight's gradient
into its main_grad themselves (`mtprun.kernels.main_grad`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def megatron_ddp_hook(param: torch.nn.Parameter, overlap: bool = True) -> list:
    """Attach DDP's hook for a DDP of one bucket (with `overlap_grad_reduce` when `overlap`,
    where the hook asserts a gradient came). Returns the list of parameters the hook marked
    ready for the bucket's reduce, appended as it runs."""
    from megatron.core.distributed import DistributedDataParallel

    ready: list = []
    bucket_group = SimpleNamespace(register_grad_ready=lambda p, *_: ready.append(p))
    ddp = SimpleNamespace(
        param_to_bucket_group={param: bucket_group},
        ddp_config=SimpleNamespace(overlap_grad_reduce=overlap),
        force_all_reduce=False,
    )
    param.grad_added_to_main_grad = False  # what DDP sets on every parameter it wraps
    hook = DistributedDataParallel._make_backward_post_hook(ddp, param)
    accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
    accumulator.register_hook(hook)
    param._test_accumulator = accumulator  # kept alive, as DDP keeps its grad_accs
    return ready
