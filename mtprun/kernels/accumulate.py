"""`addmm_into`: a GEMM accumulated into a buffer of a wider dtype, the way gradients go into
float32 main gradients (megatron-core's `main_grad`) without a bf16 intermediate."""

from __future__ import annotations

import torch


def addmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """out [M, N] += alpha a [M, K] @ b [K, N], accumulated in out's dtype.

    bf16/fp16 operands into a float32 `out` run cuBLAS's float32-output GEMM (CUDA only): the C
    operand is read and written once, with no product in the operands' dtype.
    """
    if out.dtype == a.dtype:
        out.addmm_(a, b, alpha=alpha)
    else:
        torch.addmm(out, a, b, alpha=alpha, out_dtype=out.dtype, out=out)
