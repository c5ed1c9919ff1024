"""A mixture-of-experts layer under tensor parallelism (`TensorParallelMoELayer`), and its
routed experts as two grouped GEMMs (`GroupedExperts`; megatron-core's MoE layer builds it in
place of its expert loop, `SequentialMLP`).

Megatron-core's token dispatcher hands over the tokens routed to this rank's experts sorted by
expert: x [N, H], tokens_per_expert [E_local] (counts summing to N) and each row's routing
probability p [N]. Expert e's rows r get
    out[r] = W2_e (silu(Wg_e x[r]) * (Wu_e x[r])) * p[r]
with weight1 [E_local, 2 F, H] holding [Wg_e; Wu_e] and weight2 [E_local, H, F] holding W2_e
(nn.Linear's [out, in] layout per expert, so HF's per-expert tensors map by stacking,
`mtprun.models.moe`). Both GEMMs are one `grouped_linear` each (`mtprun.kernels.grouped_gemm`:
on CUDA with bf16 weights `torch._grouped_mm` for the forward and input gradient, elsewhere,
CPU tests and float32, a loop over the experts), and on CUDA bf16 the activation is the SwiGLU
kernel; once `accumulate_wgrad_in_main_grad` (apex_standins) has set
`gradient_accumulation_fusion`, the weight gradients are added straight into megatron-core's
float32 main_grad by a Triton kernel instead of being written in bf16 for DDP's hook to add.
Under expert parallelism each rank holds E/ep experts and its weights are marked
`allreduce = False`, so megatron-core's DDP and optimizer reduce them over the
expert-data-parallel group, not every data-parallel rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from mtprun.data.device_copy import to_device
from mtprun.kernels.grouped_gemm import grouped_linear
from mtprun.runner.trainer.token_dispatch import RankDedupDispatcher

# megatron-core 0.16's router GEMM tests `te_general_gemm is not None`, but without Transformer
# Engine the name is never bound (NameError); unbound means "no TE": its torch path runs.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


class GroupedExperts(torch.nn.Module):
    """This rank's `num_local_experts` SwiGLU experts (see the module docstring)."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection=None):
        super().__init__()
        hidden, width = config.hidden_size, config.moe_ffn_hidden_size
        self.config = config
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, 2 * width, hidden, dtype=config.params_dtype)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, width, dtype=config.params_dtype)
        )
        # Replicated like the dense weights only when the expert grid is the dense one (no ep,
        # no tp: under tp each rank routes its own share of the tokens, see
        # TensorParallelMoELayer); else megatron-core reduces them over the expert-data-parallel
        # group.
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        replicated = config.expert_model_parallel_size == 1 and tp == 1
        for weight in (self.weight1, self.weight2):
            weight.allreduce = replicated  # megatron-core's mark of an expert-parallel weight
        # megatron-core's switch (as on its linear layers): add the weight gradients into
        # main_grad; `accumulate_wgrad_in_main_grad` sets it once DDP has given them one.
        self.gradient_accumulation_fusion = False

    def forward(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """x [N, H] sorted by expert, tokens_per_expert [E_local], probs [N] -> ([N, H], None)."""
        # Under ep the counts come from the host (the exchange's split sizes): copied without
        # waiting for the layer's queued exchange.
        ends = to_device(tokens_per_expert, x.device).cumsum(0).to(torch.int32)
        fused = self.gradient_accumulation_fusion
        hidden = _swiglu(grouped_linear(x, self.weight1, ends, fused))
        hidden = hidden * probs[:, None].to(hidden.dtype)
        return grouped_linear(hidden, self.weight2, ends, fused), None


def _swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for y = [gate, up]: the Triton kernel on CUDA bf16, torch elsewhere."""
    if y.is_cuda and y.dtype == torch.bfloat16:
        from mtprun.kernels.swiglu import swiglu  # Triton: imported where a GPU runs it

        return swiglu(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


class TensorParallelMoELayer(MoELayer):
    """megatron-core's MoE layer, whose every tensor-parallel rank routes 1/tp of the tokens.

    The trainer's layers keep each token on every tensor-parallel rank (no sequence
    parallelism); megatron-core's MoE layer expects each rank to hold its own share (it
    refuses to train otherwise). So: input [T, 1, H], the same on every rank -> this rank's
    ceil(T / tp) rows (the row count padded with zero rows to a multiple of tp; their outputs
    are dropped, though the router's statistics count them) -> megatron-core's layer with
    `sequence_parallel` on (the shared expert gathers the rows and scatters its output back,
    the routed experts, not split over tp, take their own tokens) -> every rank's rows
    gathered back to [T, 1, H]. The backward of the split gathers the rows' gradients, that of
    the gather keeps this rank's rows (the output's gradient is the same on every rank). The
    router's weight sees only this rank's tokens: the trainer sums its gradient over the
    tensor-parallel group (`sequence_parallel` marks it), and the experts' over the
    expert-data-parallel group. One process (tp 1) runs megatron-core's layer unchanged.
    """

    def __init__(self, config: TransformerConfig, submodules: Any = None, **kwargs: Any):
        self.split_tokens = parallel_state.get_tensor_model_parallel_world_size() > 1
        if self.split_tokens:
            config = copy.copy(config)
            config.sequence_parallel = True
        super().__init__(config, submodules, **kwargs)
        # Each token crosses to an expert rank once, not once per expert (token_dispatch.py).
        self.token_dispatcher = RankDedupDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=kwargs.get("pg_collection") or get_default_pg_collection(),
        )

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.split_tokens:
            return super().forward(hidden_states, *args, **kwargs)
        tokens, tp = hidden_states.shape[0], self.tp_group.size()
        pad = -tokens % tp
        if pad:
            hidden_states = F.pad(hidden_states, (0, 0, 0, 0, 0, pad))
        local = scatter_to_sequence_parallel_region(hidden_states, group=self.tp_group)
        output, bias = super().forward(local, *args, **kwargs)
        output = gather_from_sequence_parallel_region(
            output, tensor_parallel_output_grad=False, group=self.tp_group
        )
        return output[:tokens], bias
