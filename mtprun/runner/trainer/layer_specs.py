"""The trainer's Megatron-core layer specs: megatron-core's local transformer layer with the
options a model's family needs (read from its `ModelShape`: per-head q/k norms, zero-centred
norms, a Gated DeltaNet in a hybrid model's linear-attention layers, a mixture-of-experts MLP on
its sparse layers), its core attention packed (`mtprun.runner.trainer.attention`).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from mtprun.kernels.rms_norm import rms_norm
from mtprun.models.pp_layout import PipelineStage
from mtprun.models.qwen3_5_shape import LinearAttentionShape
from mtprun.models.shape import ModelShape
from mtprun.runner.trainer.attention import PackedAttention
from mtprun.runner.trainer.experts import GroupedExperts, TensorParallelMoELayer
from mtprun.runner.trainer.gated_delta_net import PackedGatedDeltaNet, ZeroCenteredRMSNorm


class SwiGLUActivation(torch.nn.Module):
    """The MLP's activation, silu(a) * b of the fc1 output [a, b], as one Triton kernel each
    way (`mtprun.kernels.swiglu`); built by Megatron's MLP when the config's
    `use_te_activation_func` is set (CUDA)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        from mtprun.kernels.swiglu import swiglu  # Triton: imported where a GPU runs it

        self.swiglu = swiglu

    def forward(self, fc1_out: torch.Tensor) -> torch.Tensor:
        return self.swiglu(fc1_out)


class RMSNorm(torch.nn.Module):
    """Megatron-core's norm interface (`config`, `hidden_size`, `eps`) over
    `mtprun.kernels.rms_norm` (one Triton kernel each way on CUDA, `F.rms_norm` elsewhere): the
    input, pre-MLP, q/k and final norms, in place of megatron-core's torch.nn.RMSNorm wrapper
    (the same `weight` and math; torch's CUDA backward reads the input twice)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def decoder_layer_spec(
    qk_layernorm: bool = False,
    experts: int | None = None,
    zero_centered_norm: bool = False,
    linear_attention: LinearAttentionShape | None = None,
) -> ModuleSpec:
    """Megatron-core's local transformer layer, with per-head q/k RMSNorms if `qk_layernorm`
    (`ModelShape.megatron_layer_options`), its core attention packed (flash-class on CUDA) and
    context-parallel; its MLP dense, with the activation a kernel where the config asks for
    one, or with `experts` a megatron-core MoE layer whose routed experts are
    `GroupedExperts`. `zero_centered_norm`: its RMSNorms apply (1 + w) (Qwen3.5);
    `linear_attention`: a Gated DeltaNet of those sizes in the attention's place."""
    spec = get_gpt_layer_local_spec(
        num_experts=experts, normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    layer = spec.submodules
    layer.self_attention.submodules.core_attention = PackedAttention
    norm = ZeroCenteredRMSNorm if zero_centered_norm else RMSNorm
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    if qk_layernorm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = norm
    if linear_attention is not None:
        layer.self_attention = ModuleSpec(
            module=PackedGatedDeltaNet, params={"linear": linear_attention}
        )
    if experts is None:
        layer.mlp.submodules.activation_func = SwiGLUActivation
    else:
        layer.mlp.module = TensorParallelMoELayer
        layer.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    return spec


def stage_layer_specs(shape: ModelShape, stage: PipelineStage) -> TransformerBlockSubmodules:
    """The layer spec of each decoder layer of `stage`, by whole-model layer index: sparse
    layers (`shape.is_moe_layer`) carry the experts, dense ones the dense MLP; a hybrid
    model's linear-attention layers (`shape.is_linear_attention_layer`) a Gated DeltaNet."""
    qk = shape.megatron_layer_options()["qk_layernorm"]
    count = shape.experts.count if shape.experts else None
    layers = range(stage.layer_offset, stage.layer_offset + stage.layers_per_stage)
    specs = [
        decoder_layer_spec(
            qk,
            count if shape.is_moe_layer(i) else None,
            shape.zero_centered_norm,
            shape.linear_attention if shape.is_linear_attention_layer(i) else None,
        )
        for i in layers
    ]
    norm = ZeroCenteredRMSNorm if shape.zero_centered_norm else RMSNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
