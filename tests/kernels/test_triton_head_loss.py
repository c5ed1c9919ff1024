"""The Triton head loss under the Triton interpreter (CPU) against the float64 reference.

TRITON_INTERPRET must be set before the kernels are decorated, so this module sets it before
importing them (and reloads them if another test imported them compiled).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import torch  # noqa: E402

from mtprun.compiler import HeadPlan  # noqa: E402

from .reference import reference_head_loss  # noqa: E402


def _load_interpreted():
    for name in ("coefficients", "rows", "launch", "engine", "head_loss"):
        module = sys.modules.get(f"mtprun.kernels.triton.{name}")
        if module is not None:
            importlib.reload(module)
    from mtprun.kernels.triton import head_loss, launch, rows

    assert type(rows.head_rows_kernel).__name__ == "InterpretedFunction"
    return head_loss.head_loss_triton, launch


head_loss_triton, launch = _load_interpreted()

N, H, V = 32, 16, 300
BLOCK_V = 128  # three vocab tiles, the last one partial


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(launch, "MAX_BLOCK_V", BLOCK_V)


def _batch(seed: int, active: float, dtype=torch.float32, n: int = N):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(dtype)
    mask = torch.rand(n, generator=gen) < active
    return {
        "hidden": hidden.requires_grad_(),
        "weight": weight.requires_grad_(),
        "targets": torch.randint(0, V, (n,), generator=gen),
        "loss_mask": mask,
        "advantages": torch.randn(n, generator=gen),
        "old_logprobs": -torch.rand(n, generator=gen) * 6,
        "ref_logprobs": -torch.rand(n, generator=gen) * 6,
        "mtp_hidden": [
            torch.randn(n, H, generator=gen).to(dtype).requires_grad_() for _ in range(2)
        ],
        "cu_seqlens": torch.tensor([0, 9, 20, n]),
        "teacher_hidden": torch.randn(n, H, generator=gen).to(dtype),
        "teacher_weight": torch.randn(V, H, generator=gen).to(dtype),
    }


def _arguments(plan: HeadPlan, batch: dict) -> dict:
    """Only the inputs the plan uses (validate rejects the others)."""
    args = {k: batch[k] for k in ("targets", "loss_mask", "cu_seqlens")}
    if plan.term("grpo") is not None:
        args.update({k: batch[k] for k in ("advantages", "old_logprobs", "ref_logprobs")})
    if plan.mtp_depths:
        args["mtp_hidden"] = batch["mtp_hidden"][: len(plan.mtp_depths)]
    if plan.term("distill") is not None:
        args.update({k: batch[k] for k in ("teacher_hidden", "teacher_weight")})
    return args


def _run(fn, plan: HeadPlan, batch: dict, **options):
    students = [batch["hidden"], batch["weight"], *batch["mtp_hidden"][: len(plan.mtp_depths)]]
    for tensor in students:
        tensor.grad = None
    out = fn(batch["hidden"], batch["weight"], plan, **_arguments(plan, batch), **options)
    out.loss.backward()
    grads = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in students]
    return out, grads


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-12))


def _assert_matches(plan: HeadPlan, batch: dict, tol: float, **options) -> None:
    out, grads = _run(head_loss_triton, plan, batch, **options)
    ref, ref_grads = _run(reference_head_loss, plan, batch)
    assert torch.isfinite(out.loss)
    assert float(out.loss.detach()) == pytest.approx(float(ref.loss.detach()), rel=tol, abs=tol)
    assert set(out.metrics) == set(plan.metrics)
    for name in plan.metrics:
        assert float(out.metrics[name]) == pytest.approx(
            float(ref.metrics[name]), rel=tol, abs=tol
        ), name
    torch.testing.assert_close(out.logprobs.double(), ref.logprobs.double(), rtol=tol, atol=tol)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        if ref_grad.abs().max() == 0:
            assert grad.abs().max() == 0
        else:
            assert _rel(grad, ref_grad) < tol


PLANS = {
    "sft": [{"kind": "ce"}, {"kind": "z_loss", "weight": 1e-2}],
    "grpo": [
        {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k3"},
        {"kind": "entropy", "coef": 0.01},
    ],
    "grpo_k1_seq_mean": [
        {"kind": "grpo", "kl_coef": 0.2, "kl_estimator": "k1", "loss_agg": "seq-mean-token-mean"}
    ],
    "grpo_k2_sum_norm": [
        {
            "kind": "grpo",
            "kl_coef": 0.2,
            "kl_estimator": "k2",
            "loss_agg": "seq-mean-token-sum-norm",
        },
        {"kind": "ce", "weight": 0.5},
    ],
    "mtp_soft": [{"kind": "ce"}, {"kind": "mtp", "depth": 2, "target": "soft"}],
    "mtp_hard_shared": [
        {"kind": "ce"},
        {"kind": "mtp", "depth": 1, "target": "hard", "train_shared_output": True},
    ],
    "mtp_topk": [{"kind": "ce"}, {"kind": "mtp", "depth": 2, "target": "topk", "topk": 5}],
    "distill": [{"kind": "distill", "teacher": "t", "temperature": 2.0}, {"kind": "ce"}],
}


@pytest.mark.parametrize(
    ("name", "active"), [*((name, 0.6) for name in sorted(PLANS)), ("sft", 1.0), ("mtp_soft", 1.0)]
)
def test_matches_reference_float32(name: str, active: float) -> None:
    plan = HeadPlan.from_losses(PLANS[name])
    # ~7 rows per chunk: teachers of MTP rows fall in the next chunk.
    _assert_matches(
        plan,
        _batch(seed=hash((name, active)) % 1000, active=active),
        2e-4,
        chunk_bytes=7 * V * 4 * 4,
    )


@pytest.mark.parametrize("name", ["sft", "grpo", "mtp_soft"])
def test_matches_reference_bfloat16(name: str) -> None:
    plan = HeadPlan.from_losses(PLANS[name])
    _assert_matches(plan, _batch(seed=7, active=0.5, dtype=torch.bfloat16), 3e-2)


def test_sparse_mask_and_uncompacted_rows_agree() -> None:
    plan = HeadPlan.from_losses(PLANS["grpo"])
    batch = _batch(seed=11, active=0.1)
    _assert_matches(plan, batch, 2e-4)
    uncompacted = HeadPlan.from_losses(PLANS["grpo"], compact_mask=False)
    _assert_matches(uncompacted, batch, 2e-4)


def test_all_masked_batch_gives_zero_loss_and_gradients() -> None:
    plan = HeadPlan.from_losses(PLANS["mtp_soft"])
    batch = _batch(seed=3, active=0.0)
    out, grads = _run(head_loss_triton, plan, batch)
    assert float(out.loss.detach()) == 0.0
    assert all(float(m) == 0.0 for m in out.metrics.values())
    assert all(bool((g == 0).all()) for g in grads)
    assert bool((out.logprobs == 0).all())


def test_loss_scale_reaches_gradients() -> None:
    plan = HeadPlan.from_losses(PLANS["sft"])
    batch = _batch(seed=5, active=0.7)
    out = head_loss_triton(batch["hidden"], batch["weight"], plan, **_arguments(plan, batch))
    (3.0 * out.loss).backward()
    scaled = batch["hidden"].grad.clone()
    _, grads = _run(head_loss_triton, plan, batch)
    torch.testing.assert_close(scaled, 3.0 * grads[0])


def test_missing_advantages_is_rejected_with_the_argument_name() -> None:
    plan = HeadPlan.from_losses(PLANS["grpo"])
    batch = _batch(seed=1, active=0.5)
    with pytest.raises(ValueError, match="advantages"):
        head_loss_triton(
            batch["hidden"],
            batch["weight"],
            plan,
            targets=batch["targets"],
            loss_mask=batch["loss_mask"],
        )
