"""A sparse layer's expert-parallel token exchange overlapped with its experts' compute
(`parallel.ep_chunks`).

Megatron-core's all-to-all dispatcher sends a layer's routed tokens to the ranks of their
experts, runs the experts, and sends the outputs back, each step waiting for the one before:
the two exchanges (and their two in the backward) leave the GPU's compute idle.
`exchange_routed_experts` splits the layer's tokens into chunks, each with its own exchange
sizes, and pipelines them (`OverlappedExperts`): chunk i+1's tokens travel while chunk i's
experts compute, and chunk i's outputs travel back while chunk i+1's compute, in the backward
with the gradients the same way. Each token's expert rows are the same rows the dispatcher
computes (its permutation, sorting by local expert and un-permutation are megatron-core's,
chunk by chunk), so the result equals the dispatcher's up to the GEMMs' row blocking.

Only the dropless all-to-all dispatcher with experts not split over tp (mtprun's
configuration, `model.moe_config_options`) is handled; the layer checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

# Experts of one chunk: (tokens [R, H] sorted by source rank then local expert, their
# probabilities [R], rows per (source rank, local expert) [ep, E_local]) -> outputs [R, H].
ChunkExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ChunkSplits:
    """One chunk's all-to-all sizes on this rank: rows it sends to each expert-parallel rank
    (`send`: its permuted rows are grouped by expert, so by rank), rows it receives from each
    (`receive`), and of those the rows of each local expert (`per_expert` [ep, E_local], CPU)."""

    send: list[int]
    receive: list[int]
    per_expert: torch.Tensor


def chunk_splits(
    routing_maps: Sequence[torch.Tensor], dispatcher: MoEAlltoAllTokenDispatcher
) -> list[ChunkSplits]:
    """The exchange sizes of each chunk's routing map [T_c, E]: one all-gather of every
    chunk's per-expert counts over the expert-parallel group and one device-to-host copy (the
    sizes are host arguments of the all-to-all; the dispatcher synchronises once too)."""
    ep, local = dispatcher.ep_size, dispatcher.num_local_experts
    counts = torch.stack([m.sum(0) for m in routing_maps]).long()  # [N, E]
    gathered = gather_from_sequence_parallel_region(counts, group=dispatcher.ep_group)
    gathered = gathered.view(ep, len(routing_maps), ep, local).cpu()  # [from, N, to, E_local]
    mine = gathered[:, :, dispatcher.ep_group.rank()]  # [from, N, E_local]: to my experts
    sent = gathered[dispatcher.ep_group.rank()].sum(-1)  # [N, to]
    return [
        ChunkSplits(sent[c].tolist(), mine[:, c].sum(-1).tolist(), mine[:, c])
        for c in range(len(routing_maps))
    ]


class _InFlight:
    """An asynchronous all-to-all of `tensor`'s rows (`send` rows to each rank, `receive` from
    each); `wait()` makes the current stream wait for it and gives the received rows."""

    def __init__(
        self, tensor: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup
    ) -> None:
        tensor = tensor.contiguous()
        self.output = tensor.new_empty((sum(receive), *tensor.shape[1:]))
        self.work = dist.all_to_all_single(
            self.output, tensor, receive, send, group=group, async_op=True
        )

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.output


class OverlappedExperts(torch.autograd.Function):
    """N chunks' exchange -> experts -> exchange back, each chunk's exchanges overlapping
    another chunk's experts.

    Inputs: `compute` (a `ChunkExperts`), the chunks' `ChunkSplits`, the expert-parallel
    group, whether to record the experts for backward (`grad`), then the tensors: each
    chunk's permuted tokens [M_c, H] (grouped by destination rank), each chunk's permuted
    probabilities [M_c], and the experts' trainable parameters. Outputs: each chunk's expert
    outputs [M_c, H], back on this rank in its permuted order.

    Collectives, all `all_to_all_single(async_op=True)` on the group (NCCL runs them on its
    own stream, in issue order; the compute stream waits only where an exchange's result is
    used): forward, every chunk's tokens and probabilities up front, then per chunk: wait for
    its tokens, run its experts, send its outputs back; the outputs are waited for at the
    end. Backward, mirrored: every chunk's output gradient to the expert ranks up front, then
    per chunk: wait, backward through its experts, send its token and probability gradients
    back. Each chunk's experts run under autograd in the forward (from the received rows as
    leaves, as activation checkpointing does) and `torch.autograd.grad` runs their backward;
    the parameters' gradients are summed over the chunks (in their dtype).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        compute: ChunkExperts,
        splits: list[ChunkSplits],
        group: dist.ProcessGroup,
        grad: bool,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        n = len(splits)
        tokens, probs, params = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        sent = [
            (_InFlight(t, s.receive, s.send, group), _InFlight(p, s.receive, s.send, group))
            for t, p, s in zip(tokens, probs, splits, strict=True)
        ]
        chunks, returned = [], []
        for (rows, row_probs), s in zip(sent, splits, strict=True):
            x, p = rows.wait(), row_probs.wait()
            with torch.set_grad_enabled(grad):
                x, p = x.requires_grad_(grad), p.requires_grad_(grad)
                y = compute(x, p, s.per_expert)
            chunks.append((x, p, y))
            returned.append(_InFlight(y.detach(), s.send, s.receive, group))
        ctx.splits, ctx.group, ctx.params = splits, group, params
        ctx.chunks = chunks if grad else None
        return tuple(r.wait() for r in returned)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        splits, group, params = ctx.splits, ctx.group, ctx.params
        assert ctx.chunks is not None, "OverlappedExperts ran without grad"
        arriving = [
            _InFlight(g, s.receive, s.send, group) for g, s in zip(grads, splits, strict=True)
        ]
        token_grads, prob_grads = [], []
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        for (x, p, y), s, g in zip(ctx.chunks, splits, arriving, strict=True):
            dx, dp, *dw = torch.autograd.grad(
                y, (x, p, *params), g.wait(), allow_unused=True, materialize_grads=True
            )
            token_grads.append(_InFlight(dx, s.send, s.receive, group))
            prob_grads.append(_InFlight(dp, s.send, s.receive, group))
            param_grads = [
                w if acc is None else acc + w for acc, w in zip(param_grads, dw, strict=True)
            ]
        ctx.chunks = None
        return (
            None,
            None,
            None,
            None,
            *(t.wait() for t in token_grads),
            *(q.wait() for q in prob_grads),
            *param_grads,
        )


def exchange_routed_experts(
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    experts: torch.nn.Module,
    dispatcher: MoEAlltoAllTokenDispatcher,
    chunks: int,
) -> torch.Tensor:
    """The routed experts' output for `hidden` [..., H] (as the dispatcher's dispatch ->
    experts -> combine gives it), its tokens split into `chunks` (fewer when it has fewer
    tokens) whose exchanges overlap the experts (`OverlappedExperts`). `probs` [T, E] and
    `routing_map` [T, E] are the router's; `experts(tokens, tokens_per_expert, probs)` is the
    layer's `GroupedExperts`."""
    shape = hidden.shape
    flat = hidden.reshape(-1, shape[-1])
    n = max(1, min(chunks, flat.shape[0]))
    maps = routing_map.tensor_split(n)
    splits = chunk_splits(maps, dispatcher)
    top_k = dispatcher.config.moe_router_topk
    permuted = [
        permute(h, m, probs=p, num_out_tokens=h.shape[0] * top_k)
        for h, p, m in zip(flat.tensor_split(n), probs.tensor_split(n), maps, strict=True)
    ]
    params = [w for w in experts.parameters() if w.requires_grad]
    grad = torch.is_grad_enabled() and (hidden.requires_grad or probs.requires_grad or bool(params))

    def compute(x: torch.Tensor, p: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        if dispatcher.num_local_experts > 1:  # rows by source rank -> by local expert
            x, p = sort_chunks_by_idxs(
                x, per_expert.ravel(), dispatcher.sort_input_by_local_experts, probs=p
            )
        y, _ = experts(x, per_expert.sum(0), p)
        if dispatcher.num_local_experts > 1:
            y, _ = sort_chunks_by_idxs(
                y, per_expert.T.ravel(), dispatcher.restore_output_by_local_experts
            )
        return y

    outputs = OverlappedExperts.apply(
        compute,
        splits,
        dispatcher.ep_group,
        grad,
        *(t for t, _, _ in permuted),
        *(p for _, p, _ in permuted),
        *params,
    )
    restored = [
        unpermute(y, mapping, restore_shape=m.shape[:1] + shape[-1:], routing_map=m)
        for y, (_, _, mapping), m in zip(outputs, permuted, maps, strict=True)
    ]
    return torch.cat(restored).view(shape)
