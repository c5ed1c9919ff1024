"""Weight gradients accumulated by their GEMM straight into megatron-core's float32 main
gradients (its `gradient_accumulation_fusion`), on torch instead of Apex.

Without the fusion, each of megatron-core's linear layers writes a bf16 weight gradient in
backward, and the DDP hook then adds it to the parameter's float32 `main_grad`: one more
[out, in] write and read and an add kernel per linear layer per micro batch (about 15 ms of a
0.45 s step of a 1.5B model on an H100). With it, the layer calls
`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)`, one
GEMM that computes main_grad += grad_output^T input with a float32 C operand. Apex ships that
extension; torch's `addmm(..., out_dtype=torch.float32)` is the same GEMM (bf16 operands,
float32 accumulation and output), so this module provides it and switches the layers over.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.core.tensor_parallel import layers


def _wgrad_accum(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output [..., out]^T @ input [..., in], accumulated in
    main_grad's dtype."""
    x = input.reshape(-1, input.shape[-1])
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    if main_grad.dtype == x.dtype:
        main_grad.addmm_(dy.t(), x)
    else:
        torch.addmm(main_grad, dy.t(), x, out_dtype=main_grad.dtype, out=main_grad)


_TORCH_WGRAD = SimpleNamespace(
    wgrad_gemm_accum_fp32=_wgrad_accum, wgrad_gemm_accum_fp16=_wgrad_accum
)


def accumulate_wgrad_in_main_grad(model: torch.nn.Module) -> None:
    """Turn on gradient-accumulation fusion in every megatron-core linear layer of `model`,
    whose parameters must already have `main_grad` (megatron-core's DDP gives them one).
    CUDA only: torch's float32-output GEMM with bf16 inputs is a cuBLAS feature."""
    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = _TORCH_WGRAD
    for module in model.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            module.gradient_accumulation_fusion = True
