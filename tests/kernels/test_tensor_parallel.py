"""Vocab-parallel head loss on 2 gloo processes (CPU, loopback) against the single-process
result, and its cross-entropy against Megatron-core's vocab_parallel_cross_entropy."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtprun.compiler import HeadPlan
from mtprun.kernels import Chunking, head_loss

from .cases import Problem, make_problem

TP = 2
TERMS = [
    {"kind": "ce"},
    {"kind": "z_loss", "weight": 0.01},
    {"kind": "entropy", "coef": 0.05},
    {"kind": "grpo", "kl_coef": 0.1},
    {"kind": "distill", "teacher": "t", "temperature": 2.0},
    {"kind": "mtp", "depth": 2, "target": "topk", "topk": 4, "train_shared_output": True},
]
# The grpo term's policy-loss variants (one grpo term per plan).
VARIANTS = {
    "gspo-dual-clip-tis": [
        {"kind": "ce", "weight": 0.1},
        {
            "kind": "grpo",
            "ratio": "sequence",
            "loss_agg": "seq-mean-token-mean",
            "clip_c": 1.5,
            "tis_cap": 1.5,
            "kl_coef": 0.1,
        },
    ],
    "cispo-sum-norm": [
        {"kind": "grpo", "policy_loss": "cispo", "loss_agg": "seq-mean-token-sum-norm"},
        {"kind": "entropy", "coef": 0.05},
    ],
}
CHUNKINGS = [Chunking(), Chunking(vocab_tile=7, rows_per_chunk=9)]


def _rank_main(rank: int, port: int, problems: dict[str, Problem], results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    torch.cuda.current_device = lambda: "cpu"  # Megatron-core on CPU (see docs/stack.md)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    group = parallel_state.get_tensor_model_parallel_group()
    problem = problems["all-terms"]
    shard = problem.weight.shape[0] // TP
    rows = slice(rank * shard, (rank + 1) * shard)
    outputs = {}
    for name, each in problems.items():
        outputs[name] = []
        for chunking in CHUNKINGS:
            local = _shard(each, rows)
            out = local.call(head_loss, tp_group=group, chunking=chunking)
            out.loss.backward()
            grads = [leaf.grad for leaf in local.leaves()]
            outputs[name].append((out.loss.detach(), out.metrics, out.logprobs, grads))

    # Cross-entropy alone, ours and Megatron's, on the same shard.
    ce = _shard(problem, rows)
    ce.plan, ce.mtp_hidden = HeadPlan.from_losses([{"kind": "ce"}], tp_size=TP), []
    ce.kwargs = {k: ce.kwargs[k] for k in ("targets", "loss_mask", "cu_seqlens")}
    ours_ce = ce.call(head_loss, tp_group=group)
    ours_ce.loss.backward()
    weight = problem.weight.detach()[rows].clone().requires_grad_()
    logits = (problem.hidden.detach() @ weight.T)[:, None, :]  # [s, b=1, V/tp]
    per_token = vocab_parallel_cross_entropy(logits, problem.kwargs["targets"][:, None])[:, 0]
    mask = problem.kwargs["loss_mask"]
    (per_token[mask].sum() / mask.sum()).backward()
    torch.save(
        {
            "ours": outputs,
            "ours_ce": (ours_ce.logprobs, ce.weight.grad),
            "megatron": (per_token.detach(), weight.grad),
        },
        f"{results}.{rank}",
    )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _shard(problem: Problem, rows: slice) -> Problem:
    local = problem.clone()
    local.weight = problem.weight.detach()[rows].clone().requires_grad_()
    if "teacher_weight" in local.kwargs:
        local.kwargs["teacher_weight"] = problem.kwargs["teacher_weight"][rows]
    plan = problem.plan
    local.plan = HeadPlan.compile(plan.terms, tp_size=TP, sampler_logprobs=plan.sampler_logprobs)
    return local


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_vocab_parallel_matches_single_process_and_megatron(tmp_path):
    problems = {"all-terms": make_problem(TERMS, rows=40, vocab=54, active=0.7)}
    for name, terms in VARIANTS.items():
        problems[name] = make_problem(terms, rows=40, vocab=54, active=0.7)
    results = str(tmp_path / "rank")
    clones = {name: p.clone() for name, p in problems.items()}
    mp.spawn(_rank_main, args=(_free_port(), clones, results), nprocs=TP)
    ranks = [torch.load(f"{results}.{r}") for r in range(TP)]
    for name, problem in problems.items():
        _check_ranks(name, problem, [result["ours"][name] for result in ranks])

    problem = problems["all-terms"]
    mask = problem.kwargs["loss_mask"]
    for result in ranks:
        logprobs, weight_grad = result["ours_ce"]
        per_token, megatron_weight_grad = result["megatron"]
        torch.testing.assert_close(logprobs[mask], -per_token[mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(weight_grad, megatron_weight_grad, atol=1e-6, rtol=1e-4)


def _check_ranks(name: str, problem: Problem, ranks: list) -> None:
    """Every rank's loss, metrics, log-probs and gradients (its weight shard's) equal the
    single process's, with each chunking."""
    single = problem.clone()
    expected = single.call(head_loss)
    expected.loss.backward()
    shard = problem.weight.shape[0] // TP
    for c, chunking in enumerate(CHUNKINGS):
        for rank, result in enumerate(ranks):
            loss, metrics, logprobs, grads = result[c]
            where = f"{name}, rank {rank}, {chunking}"
            torch.testing.assert_close(loss, expected.loss.detach(), msg=where)
            torch.testing.assert_close(logprobs, expected.logprobs, msg=where)
            for name, value in expected.metrics.items():
                torch.testing.assert_close(metrics[name], value, msg=f"{name}, {where}")
            rows = slice(rank * shard, (rank + 1) * shard)
            wanted = [single.hidden.grad, single.weight.grad[rows]]
            wanted += [h.grad for h in single.mtp_hidden]
            for got, want in zip(grads, wanted, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=where)
