"""The torch fused head loss against the float64 reference, on fresh random inputs."""

from __future__ import annotations

import itertools

import pytest
import torch

from mtprun.compiler import HeadPlan
from mtprun.kernels import Chunking, HeadInputs, head_loss

from .cases import assert_matches_reference, make_problem
from .reference import reference_head_loss
from .test_triton_cases import PLANS, assert_weight_grad_goes_into_main_grad, make_batch

ONE_PASS = Chunking()  # tiny vocab: one tile holds it, stats and grads from one GEMM
# 7 columns per tile and 5 rows per chunk: neither divides V=53 nor N=61.
TWO_PASS = Chunking(vocab_tile=7, rows_per_chunk=5)
SCHEDULES = pytest.mark.parametrize("chunking", [ONE_PASS, TWO_PASS], ids=["one-pass", "two-pass"])

SINGLE_TERMS = {
    "ce": [{"kind": "ce"}],
    "z_loss": [{"kind": "z_loss", "weight": 0.3}],
    "entropy": [{"kind": "entropy", "coef": 0.2}],
    "grpo-k1": [{"kind": "grpo", "kl_coef": 0.3, "kl_estimator": "k1"}],
    "grpo-k2": [{"kind": "grpo", "kl_coef": 0.3, "kl_estimator": "k2"}],
    "grpo-k3": [{"kind": "grpo", "kl_coef": 0.3, "kl_estimator": "k3", "clip_low": 0.1}],
    "distill": [{"kind": "distill", "teacher": "t", "temperature": 1.5}],
    "mtp-soft": [{"kind": "mtp", "depth": 2, "weight": 0.5}],
    "mtp-topk": [{"kind": "mtp", "target": "topk", "topk": 5, "train_shared_output": True}],
    "mtp-hard": [{"kind": "mtp", "depth": 3, "target": "hard", "train_shared_output": True}],
}
# The policy-loss variants of the grpo term (mtprun/losses/grpo.py), each with a KL.
POLICY_LOSSES = {
    "gspo": [
        {
            "kind": "grpo",
            "ratio": "sequence",
            "loss_agg": "seq-mean-token-mean",
            "clip_low": 0.3,
            "clip_high": 0.4,
            "kl_coef": 0.1,
        }
    ],
    "gspo-dual-clip-token-mean": [
        {"kind": "grpo", "ratio": "sequence", "clip_c": 1.2, "clip_high": 0.5}
    ],
    "cispo": [{"kind": "grpo", "policy_loss": "cispo", "clip_high": 0.4, "kl_coef": 0.2}],
    "cispo-gspo": [{"kind": "grpo", "policy_loss": "cispo", "ratio": "sequence"}],
    "dual-clip": [{"kind": "grpo", "clip_c": 1.5, "kl_coef": 0.1, "kl_estimator": "k2"}],
    "tis": [{"kind": "grpo", "tis_cap": 1.5, "clip_c": 2.0, "kl_coef": 0.1}],
    "tis-cispo": [{"kind": "grpo", "policy_loss": "cispo", "tis_cap": 1.2}],
    "dr-grpo": [{"kind": "grpo", "loss_agg": "seq-mean-token-sum-norm", "tis_cap": 2.0}],
}
# Several chunks over the whole vocab: a sequence-level ratio then takes two passes.
CHUNKED_WHOLE_VOCAB = Chunking(rows_per_chunk=5)
COMBINED = [
    {"kind": "ce", "loss_agg": "seq-mean-token-mean"},
    {"kind": "z_loss", "weight": 0.01},
    {"kind": "entropy", "coef": 0.05, "loss_agg": "seq-mean-token-sum-norm"},
    {"kind": "grpo", "kl_coef": 0.1},
    {"kind": "distill", "teacher": "t", "weight": 0.5},
    {"kind": "mtp", "depth": 2, "target": "topk", "topk": 3},
]


def check(problem, chunking=ONE_PASS, grad_tol=1e-4):
    ours, ref = problem.clone(), problem.clone(torch.float64)
    out = ours.call(head_loss, chunking=chunking)
    expected = ref.call(reference_head_loss)
    assert_matches_reference(out, expected, ours, ref, grad_tol=grad_tol)
    return out


@SCHEDULES
@pytest.mark.parametrize("name", list(SINGLE_TERMS))
def test_each_term_alone(name, chunking):
    check(make_problem(SINGLE_TERMS[name]), chunking)


@pytest.mark.parametrize(
    "chunking", [ONE_PASS, TWO_PASS, CHUNKED_WHOLE_VOCAB], ids=["one-pass", "two-pass", "chunks"]
)
@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_each_policy_loss_variant(name, chunking):
    problem = make_problem(POLICY_LOSSES[name], rows=67, seq_lens=[9, 20, 3, 30, 5])
    out = check(problem, chunking)
    if "tis_cap" in POLICY_LOSSES[name][0]:
        assert 0 < out.metrics["is_clip_frac"].item() < 1  # the cap bit on some tokens only


def test_policy_loss_variant_with_a_constant_sum_norm_length():
    options = {"norm_length": 48, "sampler_logprobs": True}
    problem = make_problem(POLICY_LOSSES["dr-grpo"], seq_lens=[9, 20, 3, 29], plan_options=options)
    check(problem, TWO_PASS)


def test_gspo_ratio_is_one_per_sequence():
    """The sequence ratio's value: each sequence's clipped ratio times its advantage, averaged
    over sequences, is the loss (GSPO's objective under seq-mean-token-mean)."""
    terms = [{"kind": "grpo", "ratio": "sequence", "loss_agg": "seq-mean-token-mean"}]
    problem = make_problem(terms, rows=40, active=1.0, seq_lens=[10, 10, 20])
    kwargs = problem.kwargs
    kwargs["advantages"] = torch.tensor([0.5] * 10 + [-1.0] * 10 + [2.0] * 20)
    out = problem.clone().call(head_loss)
    delta = out.logprobs - kwargs["old_logprobs"]  # every row is under the mask
    expected = []
    for start, stop, adv in ((0, 10, 0.5), (10, 20, -1.0), (20, 40, 2.0)):
        ratio = delta[start:stop].mean().exp()
        expected.append(-min(ratio * adv, ratio.clamp(0.8, 1.28) * adv))
    assert out.loss.item() == pytest.approx(float(sum(expected) / 3), rel=1e-5)


@SCHEDULES
@pytest.mark.parametrize("active", [0.0, 0.03, 0.5, 1.0])
def test_all_terms_combined_at_every_active_fraction(active, chunking):
    out = check(make_problem(COMBINED, rows=67, active=active), chunking)
    if active == 0.0:
        assert out.loss.item() == 0.0
        assert all(value.item() == 0.0 for value in out.metrics.values())


AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("loss_agg", AGGREGATIONS)
def test_aggregations_over_packed_sequences(loss_agg):
    terms = [{"kind": "ce", "loss_agg": loss_agg}, {"kind": "mtp", "loss_agg": loss_agg}]
    check(make_problem(terms, seq_lens=[1, 20, 3, 30, 7]), TWO_PASS)


@SCHEDULES
def test_bfloat16_inputs_accumulate_in_float32(chunking):
    problem = make_problem(COMBINED, dtype=torch.bfloat16)
    out = check(problem, chunking, grad_tol=2e-2)  # the gradients are rounded to bf16
    assert out.loss.dtype == torch.float32


def test_all_masked_batch_gives_zero_loss_and_zero_gradients():
    problem = make_problem(COMBINED, active=0.0).clone()
    out = problem.call(head_loss, chunking=TWO_PASS)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert not out.logprobs.any()
    for leaf in problem.leaves():
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


def test_uncompacted_plan_gives_the_compacted_result():
    compacted = make_problem(COMBINED[:4])
    kept = compacted.clone()
    kept.plan = type(kept.plan).compile(kept.plan.terms, compact_mask=False)
    a, b = compacted.clone().call(head_loss), kept.call(head_loss)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.logprobs, b.logprobs)


def test_on_policy_grpo_without_old_logprobs():
    problem = make_problem([{"kind": "grpo"}])
    del problem.kwargs["old_logprobs"], problem.kwargs["ref_logprobs"]
    out = check(problem)
    assert out.metrics["grpo/ratio_mean"].item() == pytest.approx(1.0)
    assert out.metrics["grpo/clip_frac"].item() == 0.0


def test_no_grad_forward_gives_the_same_loss():
    problem = make_problem(COMBINED)
    with torch.no_grad():
        out = problem.clone().call(head_loss)
    expected = problem.clone().call(head_loss)
    torch.testing.assert_close(out.loss, expected.loss.detach())


def test_only_the_gradients_asked_for_are_computed():
    problem = make_problem([{"kind": "ce"}]).clone()
    problem.weight.requires_grad_(False)
    problem.call(head_loss, chunking=TWO_PASS).loss.backward()
    assert problem.weight.grad is None
    assert problem.hidden.grad is not None and problem.hidden.grad.abs().sum() > 0


def test_draft_loss_never_reaches_the_policy_trunk():
    problem = make_problem([{"kind": "mtp", "depth": 2}]).clone()
    problem.call(head_loss).loss.backward()
    assert not problem.hidden.grad.any()
    assert not problem.weight.grad.any()  # train_shared_output is off
    assert all(h.grad.any() for h in problem.mtp_hidden)


def test_library_api_as_documented():
    from mtprun import HeadInputs, HeadPlan
    from mtprun import head_loss as public_head_loss

    plan = HeadPlan.from_losses([{"kind": "ce"}, {"kind": "z_loss", "weight": 1e-4}])
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    targets, mask = torch.randint(0, 40, (12,)), torch.rand(12) < 0.5
    inputs = HeadInputs.build(
        plan, hidden, weight, targets=targets, loss_mask=mask,
        advantages=None, old_logprobs=None, ref_logprobs=None,
        mtp_hidden=None, cu_seqlens=None, tp_group=None,
    )  # fmt: skip
    out = public_head_loss(inputs)
    out.loss.backward()
    assert out.loss.dim() == 0 and hidden.grad is not None and weight.grad is not None
    assert list(out.metrics) == ["entropy", "ce", "z_loss"]
    assert out.logprobs.shape == (12,) and not out.logprobs[~mask].any()


@pytest.mark.parametrize(
    ("budget", "vocab", "expected"),
    [
        (512 * 2**20, 32000, (1398, 32000)),  # one pass: 1398 rows x the whole vocab fit
        (64 * 2**20, 32000, (1024, 5461)),  # two passes: the widest tile for min_rows rows
    ],
)
def test_chunking_layout_follows_the_memory_budget(budget, vocab, expected):
    rows, tile = Chunking(memory_budget=budget).layout(vocab, buffers=3)
    assert (rows, tile) == expected
    assert rows * tile * 3 * 4 <= budget


def test_second_backward_on_one_forward_is_refused():
    problem = make_problem([{"kind": "ce"}]).clone()
    loss = problem.call(head_loss).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_calls_weighted_by_their_token_share_add_up_to_the_step(loss_agg):
    """The trainer's micro batches: each call's loss weighted by its share of the step's
    trained tokens, with the step's tokens_per_sequence, is one call over the whole step
    (sequence means over the step's sequences, not each micro batch's)."""
    terms = [{"kind": "grpo", "loss_agg": loss_agg, "ratio": "sequence", "clip_c": 2.0}]
    problem = make_problem(terms, rows=60, seq_lens=[5, 25, 4, 6, 20], active=0.8)
    problem.plan = type(problem.plan).compile(problem.plan.terms, norm_length=40)
    whole = problem.clone()
    expected = whole.call(head_loss)
    expected.loss.backward()

    mask, cu = problem.kwargs["loss_mask"], problem.kwargs["cu_seqlens"]
    total = int(mask.sum())
    sequences = sum(bool(mask[a:b].any()) for a, b in itertools.pairwise(cu.tolist()))
    split = problem.clone()
    parts = []
    for rows, bounds in ((slice(0, 30), [0, 5, 30]), (slice(30, 60), [0, 4, 10, 30])):
        kwargs = {k: v[rows] for k, v in split.kwargs.items() if k != "cu_seqlens"}
        share = int(mask[rows].sum()) / total
        inputs = HeadInputs.build(
            split.plan,
            split.hidden[rows],
            split.weight,
            **kwargs,
            cu_seqlens=torch.tensor(bounds),
            tokens_per_sequence=total / sequences,
        )
        out = head_loss(inputs)
        parts.append(share * out.loss)
    loss = sum(parts)
    loss.backward()
    torch.testing.assert_close(loss, expected.loss)
    torch.testing.assert_close(split.hidden.grad, whole.hidden.grad)
    torch.testing.assert_close(split.weight.grad, whole.weight.grad)


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_weight_gradient_goes_into_main_grad(name):
    plan = HeadPlan.from_losses(PLANS[name])
    batch = make_batch(3, 0.6, n=40, h=8, v=50)
    assert_weight_grad_goes_into_main_grad(head_loss, plan, batch)


def test_bad_main_grad_is_named():
    plan = HeadPlan.from_losses(PLANS["sft"])
    batch = make_batch(4, 0.5, n=10, h=8, v=30)
    args = {k: batch[k] for k in ("targets", "loss_mask")}
    for bad, message in [
        (torch.zeros(30, 8, dtype=torch.float64), r"must be float32 \(30, 8\)"),
        (torch.zeros(8, 30), r"got torch.float32 \(8, 30\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            HeadInputs.build(plan, batch["hidden"], batch["weight"], weight_main_grad=bad, **args)
    frozen = batch["weight"].detach()
    with pytest.raises(ValueError, match="weight does not require a gradient"):
        HeadInputs.build(plan, batch["hidden"], frozen, weight_main_grad=torch.zeros(30, 8), **args)
