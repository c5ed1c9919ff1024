"""`RankDedupDispatcher` against megatron-core's all-to-all dispatcher: the same MoE layer (its
router, its GroupedExperts) with either one gives the same output and gradients (input,
router, experts), in one process and on ep = 2 (gloo, each rank its own tokens); and on ep = 2
each token crosses to a rank once, however many of its experts that rank holds, also when
every token routes to one rank (the other's experts get none, and it sends nothing)."""

from __future__ import annotations

import pytest
import torch

from .gloo_pool import gloo_pool

HIDDEN, EXPERTS, TOP_K, TOKENS = 24, 8, 3, 37


def _moe_layer(ep: int, skewed: bool):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from mtprun.runner.trainer.layer_specs import decoder_layer_spec

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K, moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32", expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        add_bias_linear=False, params_dtype=torch.float32, use_cpu_initialization=True,
    )  # fmt: skip
    layer = build_module(decoder_layer_spec(False, EXPERTS).submodules.mlp, config=config)
    g = torch.Generator().manual_seed(11)  # every rank the same router
    rank = torch.distributed.get_rank() if ep > 1 else 0
    with torch.no_grad():
        for _, weight in sorted(layer.named_parameters()):
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.3)
        layer.experts.weight1.add_(0.1 * rank)  # and its own experts
        if skewed:  # positive inputs score the first half of the experts above the rest
            router = layer.router.weight
            router[: EXPERTS // 2].abs_()
            router[EXPERTS // 2 :] = -router[EXPERTS // 2 :].abs()
    return layer


def _forward_backward(layer, seed: int, skewed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, 1, HIDDEN, generator=g)
    x = (x.abs() + 0.1 if skewed else x).requires_grad_()
    layer.zero_grad()
    out, _ = layer(x)
    out.backward(torch.randn(out.shape, generator=g))
    grads = {name: w.grad.clone() for name, w in layer.named_parameters()}
    return {"out": out.detach(), "x": x.grad, **grads}


def _both_dispatchers(ep: int, seed: int, skewed: bool = False) -> tuple[dict, dict, list[int]]:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    layer = _moe_layer(ep, skewed)
    dedup = _forward_backward(layer, seed, skewed)
    sent = list(layer.token_dispatcher.send_splits) if ep > 1 else []
    layer.token_dispatcher = MoEAlltoAllTokenDispatcher(
        layer.num_local_experts, layer.local_expert_indices, layer.config,
        pg_collection=get_default_pg_collection(),
    )  # fmt: skip
    return dedup, _forward_backward(layer, seed, skewed), sent


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_one_process_equals_megatron_dispatcher(megatron_tp1) -> None:
    dedup, megatron, _ = _both_dispatchers(1, seed=5)
    assert dedup["out"].abs().max() > 0.1  # the experts did contribute
    _assert_equal(dedup, megatron)


def _ep_job(rank: int, layout: dict[str, int], skewed: bool):
    return _both_dispatchers(2, seed=100 + rank, skewed=skewed)


@pytest.mark.parametrize("skewed", [False, True])
def test_expert_parallel_equals_megatron_dispatcher_and_sends_a_token_once_a_rank(skewed) -> None:
    results = gloo_pool().run({"dp": 2, "ep": 2}, _ep_job, skewed)
    for dedup, megatron, sent in results:
        _assert_equal(dedup, megatron)
        assert 0 < sum(sent) <= 2 * TOKENS < TOP_K * TOKENS
        if skewed:  # every token to rank 0's experts, once
            assert sent == [TOKENS, 0]
