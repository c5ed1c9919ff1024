"""`rms_norm`: the trainer's RMSNorm (input, pre-MLP, per-head q/k and final norms) in one Triton
launch forward and one backward on CUDA; torch's own `F.rms_norm` elsewhere.

Over the last dim of x [..., H], with weight w [H] and r = 1 / sqrt(mean(x^2) + eps) per row,
    y = x r w,
and with g the incoming gradient and x^ = x r,
    dx = r (g w - x^ mean(g w x^)),   dw = sum over rows of g x^.
The arithmetic runs in float32 and rounds once (torch's `F.rms_norm` also multiplies by w
before rounding). Saved for backward: x and r [rows] (float32).

Why a kernel: torch's CUDA RMSNorm backward computes the weight gradient in a second kernel
that reads x and g again with a column-wise reduction (`GammaBetaBackward`), ~2x the
input-gradient kernel's time; on Qwen3-8B at tp = 2 the norms took 75 of the step's 857
GPU-busy ms (bench/RESULTS.md, run 90). Here each backward program keeps its weight-gradient
partial sum in registers over the rows it owns, writes it once, and one small torch sum over
the programs ends it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in x's dtype (module docstring):
    the Triton kernels on CUDA, `F.rms_norm` elsewhere."""
    if x.is_cuda:
        return RMSNormFunction.apply(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNormFunction(torch.autograd.Function):
    """y = x r w (module docstring).

    x [..., H] (made contiguous), weight [H] -> y [..., H] in x's dtype; the backward returns
    dx of x's shape and dtype and dw [H] in weight's dtype (float32 partials summed over the
    programs, then rounded once). Saves x and the float32 row factors r. No collectives
    (under tensor parallelism every rank normalizes its whole rows).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from mtprun.kernels.triton.rms_norm import launch_forward  # Triton: CUDA only

        width = x.shape[-1]
        if weight.shape != (width,):
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {width}")
        x = x.contiguous()
        rows = x.numel() // max(width, 1)
        y = torch.empty_like(x)
        factors = torch.empty(rows, dtype=torch.float32, device=x.device)
        if y.numel():
            launch_forward(x.view(rows, width), weight, y.view(rows, width), factors, eps)
        ctx.save_for_backward(x, weight, factors)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        from mtprun.kernels.triton.rms_norm import launch_backward

        x, weight, factors = ctx.saved_tensors
        width = x.shape[-1]
        rows = x.numel() // max(width, 1)
        dx = torch.empty_like(x)
        if not x.numel():
            return dx, torch.zeros_like(weight), None
        grad = grad.contiguous().view(rows, width)
        partials = launch_backward(x.view(rows, width), weight, factors, grad, dx.view(rows, width))
        return dx, partials.sum(0).to(weight.dtype), None
