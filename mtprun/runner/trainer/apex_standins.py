"""torch stand-ins for the Apex kernels megatron-core looks for, so that a machine without
Apex or Transformer Engine trains without megatron-core's slow local fallbacks.

- Gradient-accumulation fusion (`accumulate_wgrad_in_main_grad`). Without it each linear
  layer writes a bf16 weight gradient in backward that the DDP hook then adds to the
  parameter's float32 `main_grad`: one more [out, in] write and read and an add kernel per
  layer per micro batch (about 15 ms of a 0.45 s step of a 1.5B model on an H100). With it,
  the layer calls `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output,
  main_grad)`: main_grad += grad_output^T input in one GEMM with a float32 C operand, which
  torch's `addmm(..., out_dtype=torch.float32)` is. The MoE experts (`GroupedExperts`) take
  the same switch: their grouped weight gradients go into main_grad by a Triton kernel
  (`mtprun.kernels.grouped_gemm`).
- Multi-tensor l2norm and scale (`use_foreach_multi_tensor_ops`). megatron-core's local
  l2norm builds `torch.tensor([...])` from one device norm per parameter (a host sync per
  parameter, about 200 per step), and its local scale runs `dst.copy_(src * scale)` per
  parameter, also to copy the float32 master weights into the bf16 ones with scale 1.0 (a
  needless float32 multiply over every weight). torch's foreach kernels do both on the device
  in a few launches.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.tensor_parallel import layers
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

from mtprun.kernels.accumulate import addmm_into
from mtprun.runner.trainer.experts import GroupedExperts


def _wgrad_accum(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output [..., out]^T @ input [..., in], accumulated in
    main_grad's dtype."""
    x = input.reshape(-1, input.shape[-1])
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    addmm_into(main_grad, dy.t(), x)


_TORCH_WGRAD = SimpleNamespace(
    wgrad_gemm_accum_fp32=_wgrad_accum, wgrad_gemm_accum_fp16=_wgrad_accum
)


def accumulate_wgrad_in_main_grad(model: torch.nn.Module) -> None:
    """Turn on gradient-accumulation fusion in every megatron-core linear layer and every
    `GroupedExperts` of `model`, whose parameters must already have `main_grad` (megatron-core's
    DDP gives them one). CUDA only: torch's float32-output GEMM with bf16 inputs is a cuBLAS
    feature."""
    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = _TORCH_WGRAD
    fused = (layers.ColumnParallelLinear, layers.RowParallelLinear, GroupedExperts)
    for module in model.modules():
        if isinstance(module, fused):
            module.gradient_accumulation_fusion = True


def _l2norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], *args: Any
) -> tuple[torch.Tensor, None]:
    """amp_C.multi_tensor_l2norm without per-tensor norms: [1] float32, the l2 norm of every
    tensor of every list, on the device."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms)).float().reshape(1), None


def _scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """amp_C.multi_tensor_scale: dst = src * scale, list by list (dtypes may differ)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_multi_tensor_ops() -> None:
    """Replace megatron-core's local multi-tensor fallbacks (only those: Apex's or Transformer
    Engine's kernels, where installed, stay) with `_l2norm` and `_scale`."""
    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2norm
    if clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = _scale
    if megatron_optimizer.multi_tensor_scale_impl is local_multi_tensor_scale:
        megatron_optimizer.multi_tensor_scale_impl = _scale
