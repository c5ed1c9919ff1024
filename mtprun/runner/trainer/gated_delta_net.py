"""Qwen3.5's Gated DeltaNet token mixer as a Megatron-core self-attention module over packed
rows, and its zero-centred RMSNorm.

Written here rather than subclassing megatron-core 0.16's `ssm/gated_delta_net.py`
`GatedDeltaNet`: that module refuses packed sequences (`packed_seq_params` raises), needs
flash-linear-attention at construction even on CPU, and fuses q, k, v, z, b, a into one
`in_proj` whose tensor-parallel layout is its own. This one keeps the HF projections apart
(megatron's Column/RowParallelLinear, split by key head with its value heads, see
`mtprun.models.families.qwen3_5.convert`) and calls mtprun's kernels
(`mtprun.kernels.gated_delta`: fla's Triton kernels on CUDA, a chunked torch path elsewhere),
whose conv window and delta-rule state restart at every sequence start of the packed row
(`PackedRows.cu_seqlens`).

Per token t, on this rank's Hk key heads and Hv = r Hk value heads (r value heads per key head):

    [q, k, v] = silu(causal_conv1d(in_proj_qkv(x)))      q, k: [Hk, Dk]; v: [Hv, Dv]
    q, k      = l2norm(q), l2norm(k), key head h // r serving value head h (in the kernel)
    beta      = sigmoid(in_proj_b(x));   g = -exp(A_log) softplus(in_proj_a(x) + dt_bias)
    o         = gated_delta_rule(q, k, v, g, beta)       [Hv, Dv], scale Dk^-1/2
    y         = out_proj(rmsnorm(o) w * silu(in_proj_z(x)))   (rmsnorm per value head)

Context parallelism would need the state handed from rank to rank: refused at validate time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from mtprun.kernels.fused_norms import gated_rms_norm, l2_normalize, zero_centered_rms_norm
from mtprun.kernels.gated_delta import causal_conv1d, gated_delta_rule
from mtprun.models.qwen3_5_shape import LinearAttentionShape

L2NORM_EPS = 1e-6  # transformers' and fla's l2norm epsilon


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight w is stored centred on zero: y = x / rms(x) * (1 + w), computed in
    float32 and returned in x's dtype (transformers' Qwen3_5RMSNorm). Built by Megatron's layer
    specs (`config`, `hidden_size`, `eps`) as input, pre-MLP, q/k and final norm."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(torch.nn.Module):
    """The GDN output norm, per value head: rmsnorm(o) w * silu(z) (w not zero-centred; the
    norm in float32, cast back to o's dtype before the weight, as transformers does)."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=dtype))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, z, self.weight, self.eps)


class PackedGatedDeltaNet(MegatronModule):
    """A Gated DeltaNet layer's token mixer in Megatron's self-attention slot: [T, 1, H] in,
    ([T, 1, H], None) out; `attention_mask` is the micro batch's `PackedRows`."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        linear: LinearAttentionShape,
        pg_collection: ProcessGroupCollection | None = None,
        **_: Any,
    ) -> None:
        super().__init__(config)
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:  # validate refuses it first (parallel.cp); a direct build stops here
            raise ValueError(
                f"context parallelism ({cp}) with Gated DeltaNet layers: the delta-rule state "
                "would have to pass between ranks; use cp 1"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_group = pg_collection.tp
        tp = tp_group.size()
        self.layer_number = layer_number
        self.key_heads = linear.key_heads // tp
        self.value_heads = linear.value_heads // tp
        self.key_dim, self.value_dim = linear.key_dim, linear.value_dim
        self.heads_per_key = linear.heads_per_key

        def column(width: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                config.hidden_size,
                width,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=False,
                tp_group=tp_group,
            )

        self.in_proj_qkv = column(linear.conv_channels)
        self.in_proj_z = column(linear.value_heads * linear.value_dim)
        self.in_proj_b = column(linear.value_heads)
        self.in_proj_a = column(linear.value_heads)
        dtype = config.params_dtype
        self.conv_weight = torch.nn.Parameter(
            torch.empty(linear.conv_channels // tp, linear.conv_kernel, dtype=dtype)
        )
        self.A_log = torch.nn.Parameter(torch.zeros(self.value_heads, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, dtype=dtype))
        self.out_norm = GatedRMSNorm(linear.value_dim, config.layernorm_epsilon, dtype)
        self.out_proj = RowParallelLinear(
            linear.value_heads * linear.value_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=tp_group,
        )

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: Any, **_: Any
    ) -> tuple[torch.Tensor, None]:
        cu_seqlens = getattr(attention_mask, "cu_seqlens", None)
        if cu_seqlens is None:
            raise ValueError(
                "a Gated DeltaNet layer needs the packed row's cu_seqlens (PackedRows); "
                "Megatron's own GPTModel.forward does not pass them"
            )
        tokens = hidden_states.shape[0]
        qkv, _ = self.in_proj_qkv(hidden_states)
        z, _ = self.in_proj_z(hidden_states)
        b, _ = self.in_proj_b(hidden_states)
        a, _ = self.in_proj_a(hidden_states)
        # The conv weight in the projections' dtype, as autocast gives the linear layers theirs.
        weight = self.conv_weight.to(qkv.dtype)
        qkv = causal_conv1d(qkv[:, 0], weight, None, cu_seqlens, "silu")
        per_key = self.heads_per_key * self.value_dim
        q, k, v = qkv.view(tokens, self.key_heads, -1).split(
            [self.key_dim, self.key_dim, per_key], -1
        )
        # Normalised in float32, then in v's dtype as fla's kernels take them; each key head
        # serves its group of value heads inside the kernel (no repeated copy).
        q = l2_normalize(q, L2NORM_EPS)
        k = l2_normalize(k, L2NORM_EPS)
        v = v.reshape(tokens, self.value_heads, self.value_dim)
        beta = b[:, 0].sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a[:, 0].float() + self.dt_bias.float())
        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens)
        o = self.out_norm(o, z.view(tokens, self.value_heads, self.value_dim))
        out, _ = self.out_proj(o.reshape(tokens, 1, -1))
        return out, None
