"""Qwen3.5's norms, fused on the GPU: the zero-centred RMSNorm, the Gated DeltaNet output's
gated RMSNorm and the q/k l2 norm.

On CUDA each is one flash-linear-attention Triton kernel forward and one backward (`fla-core`,
already required there by the gated delta rule, `mtprun.kernels.gated_delta`); elsewhere the
torch expressions below, which are also the reference the GPU tests hold the kernels to. Each
computes in float32 and returns its input's dtype; the fused kernels skip the torch paths'
intermediate roundings (their outputs agree within a bf16 ulp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * (1 + w) over the last dim (transformers'
    `Qwen3_5RMSNorm`). 1 + w is formed in float32: in bf16 it would round w away."""
    scale = 1.0 + weight.float()
    if x.is_cuda:
        from fla.modules.norm.layernorm import rms_norm

        return rms_norm(x, scale, None, eps=eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * scale).type_as(x)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w * silu(gate) over the last dim (the GDN output norm,
    transformers' `Qwen3_5RMSNormGated`; w not zero-centred)."""
    if x.is_cuda:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(sum(x^2) + eps) over the last dim, in x's dtype."""
    if x.is_cuda:
        from fla.modules.norm.l2norm import l2norm

        return l2norm(x.contiguous(), eps, output_dtype=x.dtype)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
