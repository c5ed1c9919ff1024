"""The token embedding's gradient added into its float32 main_grad row by row
(`embedding_grad`): the same as the dense gradient of `F.embedding`, in float64, repeated tokens
summed, no gradient left for autograd (DDP's hook, where it watches, gets a dummy and marks the
weight ready); through megatron's VocabParallelEmbedding on one rank and
split over two (gloo, CPU), each rank adding only its vocabulary half's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels.megatron_hook import megatron_ddp_hook
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig

from mtprun.runner.trainer.embedding_grad import (
    EmbeddingIntoMainGrad,
    accumulate_embedding_grad_in_main_grad,
)

from .gloo_pool import gloo_pool


def _dense_grad(ids: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    w = weight.detach().double().requires_grad_()
    F.embedding(ids, w).backward(grad_out.double())
    return w.grad


def test_rows_are_added_into_main_grad_and_autograd_gets_no_weight_gradient():
    g = torch.Generator().manual_seed(0)
    vocab, hidden = 50, 8
    ids = torch.randint(0, vocab, (3, 17), generator=g)
    ids[0, :4] = 7  # a repeated token: its rows are summed
    weight = torch.randn(vocab, hidden, generator=g).requires_grad_()
    before = torch.randn(vocab, hidden, generator=g)  # earlier micro batches' sum
    weight.main_grad = before.clone()
    grad_out = torch.randn(3, 17, hidden, generator=g)

    out = EmbeddingIntoMainGrad.apply(ids, weight)
    out.backward(grad_out)

    assert torch.equal(out, F.embedding(ids, weight))
    assert weight.grad is None
    want = before.double() + _dense_grad(ids, weight, grad_out)
    torch.testing.assert_close(weight.main_grad.double(), want, rtol=1e-6, atol=1e-6)

    # Under megatron-core's DDP with the overlapped reduce: its hook gets a dummy, adds nothing
    # more, and marks the weight ready for its bucket's reduce-scatter.
    ready = megatron_ddp_hook(weight)
    EmbeddingIntoMainGrad.apply(ids, weight).backward(grad_out)
    assert ready == [weight] and weight.grad is None
    want = want + _dense_grad(ids, weight, grad_out)
    torch.testing.assert_close(weight.main_grad.double(), want, rtol=1e-6, atol=1e-6)


def _embedding(tp_group=None) -> VocabParallelEmbedding:
    """Megatron's embedding of 64 tokens x 16 on CPU (split over `tp_group` when given)."""
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True
    )
    return VocabParallelEmbedding(
        64, 16, init_method=torch.nn.init.normal_, config=config, tp_group=tp_group
    )


def test_megatron_embedding_routed_into_main_grad(megatron_tp1):
    g = torch.Generator().manual_seed(1)
    embedding, frozen = _embedding(), _embedding()
    embedding.weight.main_grad = torch.zeros(64, 16)
    model = torch.nn.ModuleList([embedding, frozen])  # frozen: no main_grad, left as it is

    accumulate_embedding_grad_in_main_grad(model)

    ids = torch.randint(0, 64, (2, 9), generator=g)
    grad_out = torch.randn(2, 9, 16, generator=g)
    out = embedding(ids)
    out.backward(grad_out)
    assert torch.equal(out.detach(), F.embedding(ids, embedding.weight.detach()))
    assert embedding.weight.grad is None
    want = _dense_grad(ids, embedding.weight, grad_out)
    torch.testing.assert_close(embedding.weight.main_grad.double(), want, rtol=1e-6, atol=1e-6)
    frozen(ids).sum().backward()
    assert frozen.weight.grad is not None  # the plain backward


def _tp_job(rank: int, layout, ids, weight, grad_out):
    """Rank `rank` of a 2-way vocab-parallel embedding (a gloo pool worker, tp=2): its
    output and main_grad."""
    from megatron.core import parallel_state

    embedding = _embedding(parallel_state.get_tensor_model_parallel_group())
    with torch.no_grad():
        embedding.weight.copy_(weight[rank * 32 : (rank + 1) * 32])
    embedding.weight.main_grad = torch.zeros(32, 16)
    accumulate_embedding_grad_in_main_grad(embedding)
    out = embedding(ids)
    out.backward(grad_out)
    return out.detach(), embedding.weight.main_grad


def test_vocab_parallel_ranks_add_their_own_rows():
    """tp = 2: each rank looks up the tokens of its half of the vocabulary (the others count 0
    before the ranks' sum) and adds only those rows to its main_grad shard."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 11), generator=g)
    weight, grad_out = torch.randn(64, 16, generator=g), torch.randn(2, 11, 16, generator=g)
    ranks = gloo_pool().run({"tp": 2}, _tp_job, ids, weight, grad_out)
    dense = _dense_grad(ids, weight, grad_out)
    for rank, (out, main_grad) in enumerate(ranks):
        torch.testing.assert_close(out, F.embedding(ids, weight), rtol=1e-6, atol=1e-6)
        want = dense[rank * 32 : (rank + 1) * 32]
        torch.testing.assert_close(main_grad.double(), want, rtol=1e-6, atol=1e-6)
