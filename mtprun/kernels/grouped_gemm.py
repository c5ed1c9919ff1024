"""`grouped_linear`: one linear layer per group of rows (the MoE experts' GEMMs), whose weight
gradient can go straight into megatron-core's float32 `main_grad`.

    grouped_linear(x [R, in], weight [E, out, in], ends [E] int32) -> y [R, out]
    y[start_e:end_e] = x[start_e:end_e] @ weight[e]^T
for the groups' contiguous row ranges (start_0 = 0, start_e = ends[e-1], end_e = ends[e]; a
group may have no rows; rows past ends[-1] are left unspecified, so ends[-1] should be R).

Forward and input gradient: on CUDA with bf16 operands one `torch._grouped_mm` each
(dx = dy_e @ W_e per group); elsewhere (CPU, float32) a loop over the groups.

Weight gradient dW[e] = dy[start_e:end_e]^T @ x[start_e:end_e] [out, in]:
- `accumulate_in_main_grad=True` and the weight has a `main_grad` (megatron-core's DDP gives
  every parameter one: float32, the weight's shape, a view into its contiguous gradient
  buffer): dW is added into main_grad by one Triton launch (float32 accumulation, each
  main_grad tile read and written once; `mtprun.kernels.triton.grouped_wgrad`), or on CPU
  without the Triton interpreter by a loop of float32 GEMMs. Then megatron's contract for
  gradient-accumulation fusion (`LinearWithGradAccumulationAndAsyncCommunication.backward`,
  megatron-core 0.16, `mtprun.kernels.main_grad`): autograd gets DDP's dummy gradient, or
  none where DDP does not watch the weight.
- otherwise: a normal gradient in the weight's dtype (on CUDA bf16 torch's own grouped GEMM,
  as torch's autograd of `_grouped_mm` computes it).
"""

from __future__ import annotations

import os
from itertools import pairwise

import torch
import torch.nn.functional as F

from mtprun.kernels.main_grad import grad_for_ddp_hook


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    accumulate_in_main_grad: bool = False,
) -> torch.Tensor:
    """x [R, in], weight [E, out, in], ends [E] int32 (cumulative row counts, on x's device)
    -> [R, out] in x's dtype (see the module docstring, also for `accumulate_in_main_grad`)."""
    return GroupedLinear.apply(x, weight, ends, accumulate_in_main_grad)


def _grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == weight.dtype == torch.bfloat16


def _segments(ends: torch.Tensor) -> list[tuple[int, int]]:
    """[(start_e, end_e)] on the host (the loop path: a sync, as the experts' loop has)."""
    return list(pairwise([0, *ends.tolist()]))


def _forward(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[R, out] = x_e @ W_e^T per group."""
    if _grouped_mm_runs(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for e, (start, end) in enumerate(_segments(ends)):
        out[start:end] = F.linear(x[start:end], weight[e])
    return out


def _input_grad(dy: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[R, in] = dy_e @ W_e per group (weight [E, out, in] as it is stored: [E, K, N])."""
    if _grouped_mm_runs(dy, weight):
        return torch._grouped_mm(dy, weight, offs=ends)
    dx = dy.new_zeros(dy.shape[0], weight.shape[2])
    for e, (start, end) in enumerate(_segments(ends)):
        dx[start:end] = dy[start:end] @ weight[e]
    return dx


def _weight_grad(dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, weight: torch.Tensor):
    """[E, out, in] in weight's dtype: dy_e^T @ x_e per group (zeros for an empty group)."""
    if _grouped_mm_runs(x, weight):
        return torch._grouped_mm(dy.t(), x, offs=ends)
    grad = weight.new_zeros(weight.shape)
    for e, (start, end) in enumerate(_segments(ends)):
        grad[e] = dy[start:end].t() @ x[start:end]
    return grad


def add_weight_grad_(
    main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor
) -> None:
    """main_grad [E, out, in] += dy_e^T @ x_e per group (dy [R, out], x [R, in]), summed in
    main_grad's dtype: one Triton launch on CUDA (or on CPU under TRITON_INTERPRET=1), else
    a loop of GEMMs."""
    triton_runs = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if triton_runs and main_grad.stride(-1) == 1:
        from mtprun.kernels.triton.grouped_wgrad import grouped_wgrad_  # Triton where it runs

        grouped_wgrad_(main_grad, dy, x, ends)
        return
    for e, (start, end) in enumerate(_segments(ends)):
        rows_dy, rows_x = dy[start:end].to(main_grad.dtype), x[start:end].to(main_grad.dtype)
        main_grad[e].addmm_(rows_dy.t(), rows_x)


class GroupedLinear(torch.autograd.Function):
    """y = x_e @ W_e^T per row group (see the module docstring).

    forward(x [R, in], weight [E, out, in], ends [E] int32, accumulate_in_main_grad: bool)
        -> [R, out]. Saves x, weight and ends; with accumulation, the weight's main_grad as
    it was at forward (as megatron-core does: a reused layer may find it swapped).
    """

    @staticmethod
    def forward(ctx, x, weight, ends, accumulate_in_main_grad):
        ctx.save_for_backward(x, weight, ends)
        ctx.main_grad = getattr(weight, "main_grad", None) if accumulate_in_main_grad else None
        return _forward(x, weight, ends)

    @staticmethod
    def backward(ctx, dy):
        x, weight, ends = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _input_grad(dy, weight, ends) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1] and ctx.main_grad is not None:
            add_weight_grad_(ctx.main_grad, dy, x, ends)
            grad_weight = grad_for_ddp_hook(weight)
        elif ctx.needs_input_grad[1]:
            grad_weight = _weight_grad(dy, x, ends, weight)
        return dx, grad_weight, None, None
