"""Bad inputs get a clear error naming the argument; row selection matches brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from mtprun.compiler import HeadPlan
from mtprun.kernels import Chunking, HeadInputs, head_loss
from mtprun.kernels.row_groups import mtp_valid, sequence_ids

from .cases import make_problem

ALL_TERMS = [
    {"kind": "ce"},
    {"kind": "grpo", "kl_coef": 0.1},
    {"kind": "distill", "teacher": "t"},
    {"kind": "mtp", "depth": 2},
]


def call(**changes):
    problem = make_problem(ALL_TERMS, rows=20, vocab=30)
    kwargs = dict(problem.kwargs, mtp_hidden=problem.mtp_hidden)
    args = {"hidden": problem.hidden, "weight": problem.weight, "plan": problem.plan}
    for name, change in changes.items():
        target = args if name in args else kwargs
        target[name] = change(target.get(name)) if callable(change) else change
    return head_loss(HeadInputs.build(args["plan"], args["hidden"], args["weight"], **kwargs))


def set_row(tensor, row, value):
    tensor = tensor.detach().clone()
    tensor[row] = value
    return tensor


BAD_INPUTS = {
    "hidden 1-D": ({"hidden": lambda h: h[0]}, ValueError, "hidden must be 2-D"),
    "hidden int": ({"hidden": lambda h: h.long()}, TypeError, "hidden must be a floating"),
    "weight transposed": ({"weight": lambda w: w.T}, ValueError, "weight has hidden size"),
    "weight dtype": ({"weight": lambda w: w.double()}, TypeError, "weight dtype"),
    "targets shape": ({"targets": lambda t: t[:5]}, ValueError, r"targets must have shape \[20\]"),
    "targets float": ({"targets": lambda t: t.float()}, TypeError, "targets must hold integer"),
    "targets >= V": ({"targets": lambda t: t + 30}, ValueError, r"targets must lie in \[0, 30\)"),
    "targets < 0": ({"targets": lambda t: t - 31}, ValueError, r"targets must lie in \[0, 30\)"),
    "mask float": ({"loss_mask": lambda m: m.float()}, TypeError, "loss_mask must be a bool"),
    "mask shape": ({"loss_mask": lambda m: m[1:]}, ValueError, "loss_mask must have shape"),
    "no advantages": ({"advantages": None}, ValueError, "pass advantages="),
    "advantages shape": ({"advantages": lambda a: a[:3]}, ValueError, "advantages must have"),
    "no ref for kl": ({"ref_logprobs": None}, ValueError, "kl_coef=0.1: pass ref_logprobs"),
    "no mtp_hidden": ({"mtp_hidden": None}, ValueError, "pass mtp_hidden="),
    "mtp_hidden tensor": (
        {"mtp_hidden": lambda m: m[0]},
        ValueError,
        "a list with one",
    ),
    "mtp depth": ({"mtp_hidden": lambda m: m[:1]}, ValueError, "mtp depth is 2"),
    "mtp_hidden shape": (
        {"mtp_hidden": lambda m: [m[0], m[1][:, :4]]},
        ValueError,
        r"mtp_hidden\[1\] \(head 2\) must match hidden",
    ),
    "no teacher": ({"teacher_hidden": None}, ValueError, "pass teacher_hidden="),
    "teacher vocab": (
        {"teacher_weight": lambda w: w[:10]},
        ValueError,
        "teacher_weight has 10 vocab rows",
    ),
    "cu_seqlens end": (
        {"cu_seqlens": torch.tensor([0, 5, 19])},
        ValueError,
        "cu_seqlens must rise from 0 to N=20",
    ),
    "cu_seqlens float": (
        {"cu_seqlens": torch.tensor([0.0, 20.0])},
        TypeError,
        "cu_seqlens must hold integers",
    ),
    "nan hidden": (
        {"hidden": lambda h: set_row(h, slice(None), float("nan"))},
        ValueError,
        "hidden holds non-finite values",
    ),
    "inf mtp_hidden": (
        {"mtp_hidden": lambda m: [m[0], set_row(m[1], slice(None), float("inf"))]},
        ValueError,
        r"mtp_hidden\[1\] holds non-finite",
    ),
    "sampler log-probs the plan does not take": (
        {"sampler_logprobs": torch.zeros(20)},
        ValueError,
        "sampler_logprobs was given but the plan does not take them",
    ),
    "no sampler log-probs for tis_cap": (
        {"plan": HeadPlan.from_losses([{"kind": "grpo", "tis_cap": 2.0}])},
        ValueError,
        r"the plan has tis_cap=2.0: pass old_logprobs=\[N\] .* and sampler_logprobs=\[N\]",
    ),
    "sampler log-probs shape": (
        {
            "plan": HeadPlan.from_losses([{"kind": "ce"}], sampler_logprobs=True),
            "sampler_logprobs": torch.zeros(3),
        },
        ValueError,
        r"sampler_logprobs must have shape \[20\]",
    ),
    "tokens per sequence": (
        {"tokens_per_sequence": 0.0},
        ValueError,
        "tokens_per_sequence must be > 0",
    ),
    "not a plan": ({"plan": [{"kind": "ce"}]}, TypeError, "plan must be a HeadPlan"),
    "tp size": (
        {"plan": HeadPlan.from_losses([{"kind": "ce"}], tp_size=2)},
        ValueError,
        "compiled for tp_size=2",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_reported_by_name(name):
    changes, error, message = BAD_INPUTS[name]
    with pytest.raises(error, match=message):
        call(**changes)


def test_topk_larger_than_the_vocab_is_rejected():
    problem = make_problem([{"kind": "mtp", "target": "topk", "topk": 5}], vocab=4)
    with pytest.raises(ValueError, match="topk=5 exceeds the vocabulary size 4"):
        problem.call(head_loss)


def test_non_finite_hidden_outside_the_mask_is_harmless():
    problem = make_problem([{"kind": "ce"}], rows=20, active=0.5)
    masked_row = int((~problem.kwargs["loss_mask"]).nonzero()[0])
    problem.hidden = set_row(problem.hidden, masked_row, float("nan")).requires_grad_()
    out = problem.call(head_loss)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(problem.hidden.grad).all()


def test_finite_row_whose_sum_overflows_is_accepted():
    """The quick check sums each row in float32; an overflowing sum of finite values must go
    to the exact check and pass it, not be reported as non-finite."""
    problem = make_problem([{"kind": "ce"}], rows=20, active=1.0)
    huge = torch.finfo(torch.float32).max
    with torch.no_grad():
        row = problem.hidden.detach().clone()
        row[3] = huge
    assert not torch.isfinite(row[3].sum())
    problem.hidden = row.requires_grad_()
    problem.call(head_loss)  # no error: every value is finite


@pytest.mark.parametrize(
    ("field", "value"), [("memory_budget", 0), ("vocab_tile", -1), ("rows_per_chunk", 0)]
)
def test_bad_chunking_is_rejected(field, value):
    with pytest.raises(ValueError, match=f"Chunking.{field} must be a positive integer"):
        Chunking(**{field: value})


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_mtp_valid_rows_match_brute_force(depth):
    gen = torch.Generator()
    gen.seed()
    n = 50
    mask = torch.rand(n, generator=gen) < 0.7
    cuts = sorted(torch.randperm(n - 1, generator=gen)[:6].add(1).tolist())
    cu_seqlens = torch.tensor([0, *cuts, n])
    seq = sequence_ids(cu_seqlens, n)
    expected = [
        t
        for t in range(n - depth)
        if mask[t] and mask[t + depth] and any(a <= t and t + depth < b for a, b in _spans(cuts, n))
    ]
    assert mtp_valid(mask, seq, depth).nonzero().squeeze(1).tolist() == expected


def _spans(cuts, n):
    bounds = [0, *cuts, n]
    return list(itertools.pairwise(bounds))
