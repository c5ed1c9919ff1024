"""Qwen3.5's Gated DeltaNet layers under context parallelism: two gloo processes of cp=2 (each
holding two chunks of every packed row, `TokenShard`) give the hidden states and the weight
gradients of one process, on rows whose sequences start inside chunks, at chunk starts, run
over three chunks and over chunks shorter than the conv window; and the plan that carries the
conv halo and the delta-rule state between ranks, checked by itself against the row."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mtprun.kernels.gated_delta import causal_conv1d, gated_delta_rule
from mtprun.models import ModelShape, hf_to_megatron
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.runner.trainer.gated_delta_net import ContextParallelPlan

from .gloo_pool import gloo_pool
from .qwen3_5_folders import build_qwen3_5_folder

# Packed rows (sequence lengths) and how cp=2 cuts them into 4 chunks:
ROWS = [
    [9, 14, 6],  # 29 tokens, chunks at 7/14/21: starts inside chunks 1 and 3, all continue
    [3, 40, 5],  # 48: the second sequence runs through chunks 1 and 2 into 3
    [7, 7, 15],  # 29: chunks 1 and 2 begin at sequence starts
    [8],  # chunks of 2 tokens, shorter than the conv window's 3 earlier rows
]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes: OpenMP fork/join costs more than it saves (15x the time of one thread
    here on a loaded two-core machine), as in tests/kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


HK, H, DK, DV = 2, 4, 8, 4  # key heads, value heads (two per key head), their widths


def _conv_and_rule(x, weight, g, beta, cu_seqlens, plan=None):
    """The layer's token mixing on [T, C] conv inputs: conv, split into q, k (l2-normalised)
    and v, the gated delta rule; `plan`: the context-parallel form of it, with
    `tails`/`ends` the callables standing in for the two all_gathers."""
    y = causal_conv1d(x, weight, None, cu_seqlens, "silu")
    q, k, v = y.split([HK * DK, HK * DK, H * DV], -1)
    q, k = (F.normalize(t.unflatten(-1, (HK, DK)), dim=-1) for t in (q, k))
    return gated_delta_rule(q, k, v.unflatten(-1, (H, DV)), g, beta, cu_seqlens)


def _by_ranks(x, weight, g, beta, cu_seqlens, size):
    """The same on `size` simulated context-parallel ranks, their all_gathers replaced by
    concatenating every rank's tensors: each rank's output rows [T_local, H, Dv] and index."""
    total = x.shape[0]
    shards = [TokenShard(r, size, total) for r in range(size)]
    plans = [ContextParallelPlan.of(cu_seqlens, s, weight.shape[-1]) for s in shards]
    xs = [x[s.index] for s in shards]
    tails = torch.cat([p.conv_tails(x_r) for p, x_r in zip(plans, xs, strict=True)])
    local = []
    for plan, shard, x_r in zip(plans, shards, xs, strict=True):
        y = plan.conv(x_r, weight, tails)
        q, k, v = y.split([HK * DK, HK * DK, H * DV], -1)
        q, k = (F.normalize(t.unflatten(-1, (HK, DK)), dim=-1) for t in (q, k))
        index = shard.index
        local.append(plan.delta_rule_local(q, k, v.unflatten(-1, (H, DV)), g[index], beta[index]))
    ends = torch.cat([e for _, e in local])
    return [
        (shard.index, plan.delta_rule_finish(out, ends))
        for plan, shard, (out, _) in zip(plans, shards, local, strict=True)
    ]


@pytest.mark.parametrize("width", [4, 2, 1])
def test_plan_gives_every_rank_the_rows_of_the_whole_row(width):
    """Float64, cp = 2, 3 and 4 simulated in one process: every rank's conv and delta-rule
    outputs, and the gradients of every input through all ranks, equal the whole row's to
    rounding; rows with empty sequences, a sequence over several of the kernel's 64-token
    chunks, and chunks of one token under a window reaching back three."""
    rows = [*ROWS, [0, 5, 0, 20, 0], [130, 3]]
    generator = torch.Generator().manual_seed(width)
    for lengths, size in itertools.product(rows, (2, 3, 4)):
        total = sum(lengths)
        if total < 2 * size:
            continue
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)])
        channels = 2 * HK * DK + H * DV
        leaves = {
            "x": torch.randn(total, channels, generator=generator, dtype=torch.float64),
            "weight": torch.randn(channels, width, generator=generator, dtype=torch.float64),
            "g": -F.softplus(torch.randn(total, H, generator=generator, dtype=torch.float64)),
            "beta": torch.rand(total, H, generator=generator, dtype=torch.float64),
        }
        probe = torch.randn(total, H, DV, generator=generator, dtype=torch.float64)
        whole = {n: t.clone().requires_grad_() for n, t in leaves.items()}
        expected = _conv_and_rule(*whole.values(), cu_seqlens)
        (expected * probe).sum().backward()
        ranks = {n: t.clone().requires_grad_() for n, t in leaves.items()}
        outputs = _by_ranks(*ranks.values(), cu_seqlens, size)
        joined = torch.full_like(expected, float("nan"))
        for index, out in outputs:
            joined[index] = out
        sum((out * probe[index]).sum() for index, out in outputs).backward()
        case = f"lengths {lengths}, cp {size}"
        torch.testing.assert_close(joined, expected, rtol=1e-10, atol=1e-10, msg=case)
        for name, tensor in whole.items():
            torch.testing.assert_close(
                ranks[name].grad, tensor.grad, rtol=1e-10, atol=1e-10, msg=f"{case}: {name}"
            )


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory, tokenizer):
    return build_qwen3_5_folder(tokenizer, tmp_path_factory.mktemp("qwen3_5_cp"), seed=4)


def _rows(vocab: int) -> list[dict[str, torch.Tensor]]:
    """Each row's tokens, boundaries and a random probe [T, hidden] for the loss."""
    generator = torch.Generator().manual_seed(31)
    rows = []
    for lengths in ROWS:
        total = sum(lengths)
        rows.append(
            {
                "input_ids": torch.randint(0, vocab, (total,), generator=generator),
                "position_ids": torch.cat([torch.arange(n) for n in lengths]),
                "cu_seqlens": torch.tensor(
                    [0, *torch.tensor(lengths).cumsum(0)], dtype=torch.int32
                ),
                "probe": torch.randn(total, 128, generator=generator),
            }
        )
    return rows


def _hidden_and_grads(rank: int, layout: dict[str, int], model_dir, rows):
    """A pool worker: the policy model over this rank's share of each row, loss = sum of the
    final hidden states times the row's probe; the hidden states by row and the weight
    gradients summed over the rows (this rank's part of them)."""
    from megatron.core import parallel_state

    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    torch.manual_seed(0)
    shape = ModelShape.from_model_dir(model_dir)
    model = PolicyModel(shape)
    load_megatron_weights(model, hf_to_megatron(load_file(model_dir / "model.safetensors"), shape))
    size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    hidden = []
    for row in rows:
        shard = TokenShard(cp_rank, size, row["input_ids"].numel())
        index = shard.index
        final, _ = model.hidden_states(
            row["input_ids"][index], row["position_ids"][index], row["cu_seqlens"], shard=shard
        )
        (final * row["probe"][index]).sum().backward()
        hidden.append((index, final.detach()))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden, grads


def test_cp2_gives_the_hidden_states_and_gradients_of_one_process(qwen3_5_dir):
    """The tiny Qwen3.5 (three GDN layers, one gated attention layer) on each row of `ROWS`:
    the final hidden states of the two ranks, put back in row order, within 1e-5 of one
    process; every weight's gradient summed over the ranks within 1e-4 of its largest entry
    (A_log's and dt_bias's, sums over every token of cancelling terms, are the loosest)."""
    vocab = ModelShape.from_model_dir(qwen3_5_dir).vocab
    rows = _rows(vocab)
    pool = gloo_pool()
    ranks = pool.run({"cp": 2}, _hidden_and_grads, qwen3_5_dir, rows)  # starts both workers
    ((one_hidden, one_grads),) = pool.run({}, _hidden_and_grads, qwen3_5_dir, rows)
    for i, (_, whole) in enumerate(one_hidden):
        joined = torch.full_like(whole, float("nan"))
        for hidden, _ in ranks:
            index, local = hidden[i]
            joined[index] = local
        torch.testing.assert_close(joined, whole, rtol=1e-5, atol=1e-5, msg=f"row {ROWS[i]}")
    assert ranks[0][1].keys() == one_grads.keys()
    assert any("in_proj_qkv" in n for n in one_grads) and any("A_log" in n for n in one_grads)
    for name, grad in one_grads.items():
        summed = ranks[0][1][name] + ranks[1][1][name]
        scale = grad.abs().max().item()
        torch.testing.assert_close(summed, grad, rtol=1e-4, atol=1e-4 * scale, msg=name)
