"""The token embedding's gradient added into its float32 main_grad row by row
(`embedding_grad`): the same as the dense gradient of `F.embedding`, in float64, repeated tokens
summed, no gradient left for autograd; through megatron's VocabParallelEmbedding on one rank and
split over two (gloo, CPU), each rank adding only its vocabulary half's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig

from mtprun.runner.trainer.embedding_grad import (
    EmbeddingIntoMainGrad,
    accumulate_embedding_grad_in_main_grad,
)


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


def _tp_rank(rank: int, port: int, ids, weight, grad_out, results) -> None:
    """One rank of a 2-way vocab-parallel embedding (gloo on CPU): its output and main_grad."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        embedding = _embedding(parallel_state.get_tensor_model_parallel_group())
        with torch.no_grad():
            embedding.weight.copy_(weight[rank * 32 : (rank + 1) * 32])
        embedding.weight.main_grad = torch.zeros(32, 16)
        accumulate_embedding_grad_in_main_grad(embedding)
        out = embedding(ids)
        out.backward(grad_out)
        results.put((rank, out.detach().numpy(), embedding.weight.main_grad.numpy()))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_vocab_parallel_ranks_add_their_own_rows():
    """tp = 2: each rank looks up the tokens of its half of the vocabulary (the others count 0
    before the ranks' sum) and adds only those rows to its main_grad shard."""
    import torch.multiprocessing as mp

    from mtprun.runner.net import free_port

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 11), generator=g)
    weight, grad_out = torch.randn(64, 16, generator=g), torch.randn(2, 11, 16, generator=g)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (free_port(), ids, weight, grad_out, results)
    procs = [ctx.Process(target=_tp_rank, args=(rank, *args)) for rank in range(2)]
    for proc in procs:
        proc.start()
    got = {}
    for _ in procs:
        rank, out, main_grad = results.get(timeout=120)
        got[rank] = (torch.from_numpy(out), torch.from_numpy(main_grad))
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    dense = _dense_grad(ids, weight, grad_out)
    for rank, (out, main_grad) in got.items():
        torch.testing.assert_close(out, F.embedding(ids, weight), rtol=1e-6, atol=1e-6)
        want = dense[rank * 32 : (rank + 1) * 32]
        torch.testing.assert_close(main_grad.double(), want, rtol=1e-6, atol=1e-6)
