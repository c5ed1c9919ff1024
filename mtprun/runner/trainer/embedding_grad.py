"""The token embedding's gradient added straight into its float32 `main_grad`, row by row.

Under megatron-core's DDP a parameter's gradient lands in a float32 `main_grad` buffer. The
linear layers' weight-gradient GEMMs accumulate into it directly (`apex_standins`); the
embedding's backward (`F.embedding`'s) instead writes a dense bf16 [V, H] gradient that is
zero except for the rows of the micro batch's tokens, which DDP's hook then adds to
`main_grad`. At a 248k vocabulary and H = 4096 that is a 2 GB zero-fill and scatter plus a
10 GB read-modify-write per micro batch, for the 4096 rows that carry anything (~5 ms of a
0.6 s step on an H100, per micro batch). Here the backward adds the rows alone:
`main_grad.index_add_(0, ids, grad)`, and hands autograd DDP's dummy gradient
(`mtprun.kernels.main_grad`: its hook adds nothing, and marks the weight's bucket ready).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from mtprun.kernels.main_grad import grad_for_ddp_hook


class EmbeddingIntoMainGrad(torch.autograd.Function):
    """out = weight[ids]; backward: weight.main_grad[ids[i]] += grad_out[i] (float32).

    forward(ids [*] int64 in [0, V_local), weight [V_local, H] with a `main_grad` [V_local, H])
        -> [*, H] in weight's dtype. No collectives (the caller reduces over tensor-parallel
    ranks, as megatron's VocabParallelEmbedding does). Saved for backward: ids.
    """

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        rows = grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype)
        main_grad.index_add_(0, ids.reshape(-1), rows)
        return None, grad_for_ddp_hook(ctx.weight)


def _forward_into_main_grad(self: VocabParallelEmbedding, input_: torch.Tensor) -> torch.Tensor:
    """megatron-core 0.16's VocabParallelEmbedding.forward with the lookup above: tokens outside
    this rank's vocabulary shard look up row 0 and are zeroed, then the ranks' rows are summed
    (or reduce-scattered along the sequence under sequence parallelism)."""
    sharded = self.tp_group.size() > 1
    ids = input_
    if sharded:
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
    out = EmbeddingIntoMainGrad.apply(ids, self.weight)
    if sharded:
        out = out.masked_fill(outside[..., None], 0.0)
    if self.reduce_scatter_embeddings:
        out = out.transpose(0, 1).contiguous()  # [b s h] -> [s b h], as megatron does
        return reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
    return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)


def accumulate_embedding_grad_in_main_grad(model: torch.nn.Module) -> None:
    """Route the backward of every trained VocabParallelEmbedding of `model` into its weight's
    `main_grad` (megatron-core's DDP must have given it one; frozen copies are left alone).
    Not under megatron's deterministic mode: index_add_ adds a repeated token's rows in no
    fixed order on CUDA."""
    for module in model.modules():
        if (
            isinstance(module, VocabParallelEmbedding)
            and hasattr(module.weight, "main_grad")
            and not module.deterministic_mode
        ):
            module.forward = types.MethodType(_forward_into_main_grad, module)
