"""The overlapped expert-parallel exchange (`expert_exchange`) against megatron-core's
all-to-all dispatcher on two expert-parallel ranks: outputs and every gradient (tokens,
router probabilities, expert weights), in 1, 2 and 3 chunks, with uneven token counts,
experts that get no token from a rank and one that gets none at all."""

from __future__ import annotations

from typing import Any

import torch

from .gloo_pool import gloo_pool

EXPERTS, TOP_K, HIDDEN, WIDTH = 6, 2, 32, 16
# Experts each rank never routes to: expert 4 gets no token, 1 none from rank 0, 5 none from 1.
AVOIDED = {0: (1, 4), 1: (4, 5)}
TOKENS = {0: 13, 1: 7}


def _inputs(rank: int, device: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tokens [T, 1, H], its router's probabilities and routing map [T, E]
    (top-2 of the experts it may choose), and the output gradient [T, 1, H]."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    tokens = TOKENS[rank]
    logits = torch.randn(tokens, EXPERTS, generator=g)
    logits[:, list(AVOIDED[rank])] = -torch.inf
    top = logits.topk(TOP_K, dim=-1)
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros(tokens, EXPERTS).scatter(1, top.indices, top.values.softmax(-1))
    return {
        "hidden": torch.randn(tokens, 1, HIDDEN, generator=g).to(device, dtype),
        "probs": probs.to(device),
        "routing_map": routing_map.to(device),
        "grad": torch.randn(tokens, 1, HIDDEN, generator=g).to(device, dtype),
    }


def exchange_job(
    rank: int, layout: dict[str, int], device: str, dtype: torch.dtype, chunk_counts: tuple
) -> dict[Any, dict[str, torch.Tensor]]:
    """On each rank of dp=2, ep=2: the dispatcher's output and gradients (key 0) and those of
    the overlapped exchange in each of `chunk_counts` chunks, on the same inputs and
    weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from mtprun.runner.trainer.expert_exchange import exchange_routed_experts
    from mtprun.runner.trainer.experts import GroupedExperts

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, moe_ffn_hidden_size=WIDTH,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall", params_dtype=dtype, use_cpu_initialization=True,
    )  # fmt: skip
    local = EXPERTS // 2
    dispatcher = MoEAlltoAllTokenDispatcher(
        local, list(range(rank * local, (rank + 1) * local)), config,
        ProcessGroupCollection.use_mpu_process_groups(),
    )  # fmt: skip
    experts = GroupedExperts(local, config).to(device)
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for weight in experts.parameters():
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.3)
    inputs = _inputs(rank, device, dtype, seed=1)

    def dispatched(hidden, probs, routing_map):
        x, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
        x, p = dispatcher.token_dispatch(x, p)
        x, tokens_per_expert, p = dispatcher.dispatch_postprocess(x, p)
        y, _ = experts(x, tokens_per_expert, p)
        y = dispatcher.token_combine(dispatcher.combine_preprocess(y))
        return dispatcher.combine_postprocess(y)

    results = {}
    for chunks in (0, *chunk_counts):
        hidden = inputs["hidden"].clone().requires_grad_(True)
        probs = inputs["probs"].clone().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        if chunks:
            out = exchange_routed_experts(
                hidden, probs, inputs["routing_map"], experts, dispatcher, chunks
            )
        else:
            out = dispatched(hidden, probs, inputs["routing_map"])
        out.backward(inputs["grad"])
        results[chunks] = {
            "out": out.detach().cpu(),
            "hidden": hidden.grad.cpu(),
            "probs": probs.grad.cpu(),
            **{name: w.grad.cpu() for name, w in experts.named_parameters()},
        }
    return results


def check_chunks_equal_the_dispatcher(
    ranks: list[dict[Any, dict[str, torch.Tensor]]], rtol: float, atol: float
) -> None:
    """Every chunk count's results equal the dispatcher's on every rank (`exchange_job`)."""
    for rank, results in enumerate(ranks):
        want = results.pop(0)
        for chunks, got in results.items():
            for name, tensor in want.items():
                assert got[name].abs().sum() > 0 or tensor.abs().sum() == 0, name
                where = f"rank {rank}, {chunks} chunks, {name}"
                torch.testing.assert_close(
                    got[name], tensor, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}"
                )


def test_overlapped_exchange_equals_the_dispatcher():
    ranks = gloo_pool().run({"dp": 2, "ep": 2}, exchange_job, "cpu", torch.float32, (1, 2, 3))
    check_chunks_equal_the_dispatcher(ranks, rtol=1e-5, atol=1e-6)
