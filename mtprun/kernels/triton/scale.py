"""`scale_`: multiply gradients by the incoming gradient of the loss, decided on the device.

The head loss computes its gradients in the forward pass, so the backward only scales them by
d(out)/d(loss). That factor is almost always exactly 1 (`loss.backward()`), and skipping the
multiply then saves a read and a write of the [V, H] weight gradient; but reading the factor
on the host would stall the backward until the whole forward's GPU work is done. This kernel
reads it on the device and returns at once when it is 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_PROGRAMS = 1024  # grid-stride: a factor of 1 costs 1024 tiny programs, not numel / BLOCK


@triton.jit
def scale_kernel(x_ptr, factor_ptr, numel, BLOCK: tl.constexpr):
    """x[i] *= factor for all i < numel, unless factor == 1 (then nothing is read)."""
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        for start in range(0, numel, step):
            index = start + offsets
            inside = index < numel
            x = tl.load(x_ptr + index, mask=inside)
            tl.store(x_ptr + index, (x.to(tl.float32) * factor).to(x.dtype), mask=inside)


def scale_(tensor: torch.Tensor, factor: torch.Tensor) -> None:
    """tensor *= factor (0-d, on tensor's device) in place."""
    if not tensor.is_contiguous():  # not one flat range: let torch walk the strides
        tensor.mul_(factor.to(tensor.dtype))
        return
    numel = tensor.numel()
    if numel:
        programs = min(_PROGRAMS, triton.cdiv(numel, _BLOCK))
        scale_kernel[(programs,)](tensor, factor, numel, BLOCK=_BLOCK)
