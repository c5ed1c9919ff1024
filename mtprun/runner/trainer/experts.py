"""The routed experts of a mixture-of-experts layer as two grouped GEMMs (megatron-core's
MoE layer builds it in place of its expert loop, `SequentialMLP`).

Megatron-core's token dispatcher hands over the tokens routed to this rank's experts sorted by
expert: x [N, H], tokens_per_expert [E_local] (counts summing to N) and each row's routing
probability p [N]. Expert e's rows r get
    out[r] = W2_e (silu(Wg_e x[r]) * (Wu_e x[r])) * p[r]
with weight1 [E_local, 2 F, H] holding [Wg_e; Wu_e] and weight2 [E_local, H, F] holding W2_e
(nn.Linear's [out, in] layout per expert, so HF's per-expert tensors map by stacking,
`mtprun.models.moe`). On CUDA with bf16 weights both GEMMs are one `torch._grouped_mm` each
(its backward too) and the activation is the SwiGLU kernel; elsewhere (CPU tests, float32)
a loop over the experts computes the same. Under expert parallelism each rank holds E/ep
experts and its weights are marked `allreduce = False`, so megatron-core's DDP and optimizer
reduce them over the expert-data-parallel group, not every data-parallel rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils

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
        replicated = config.expert_model_parallel_size == 1
        for weight in (self.weight1, self.weight2):
            weight.allreduce = replicated  # megatron-core's mark of an expert-parallel weight

    def forward(
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """x [N, H] sorted by expert, tokens_per_expert [E_local], probs [N] -> ([N, H], None)."""
        if x.is_cuda and x.dtype == torch.bfloat16:
            from mtprun.kernels.swiglu import swiglu  # Triton: imported where a GPU runs it

            ends = tokens_per_expert.to(x.device).cumsum(0).to(torch.int32)
            hidden = torch._grouped_mm(x, self.weight1.transpose(-2, -1), offs=ends)
            hidden = swiglu(hidden) * probs[:, None].to(hidden.dtype)
            return torch._grouped_mm(hidden, self.weight2.transpose(-2, -1), offs=ends), None
        counts = tokens_per_expert.tolist()
        outputs = []
        for e, (rows, p) in enumerate(zip(x.split(counts), probs.split(counts), strict=True)):
            gate, up = F.linear(rows, self.weight1[e]).chunk(2, dim=-1)
            hidden = (F.silu(gate) * up * p[:, None]).to(rows.dtype)
            outputs.append(F.linear(hidden, self.weight2[e]))
        return torch.cat(outputs), None
