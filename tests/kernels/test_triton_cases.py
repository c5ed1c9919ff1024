"""Shared cases of the Triton head-loss tests (interpreter and GPU): plans, random batches
and the comparison with the float64 reference. Holds no tests itself and imports no triton,
so either test module can set TRITON_INTERPRET first."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from mtprun.compiler import HeadPlan
from mtprun.kernels import HeadInputs

from .megatron_hook import megatron_ddp_hook
from .reference import reference_head_loss

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
    # The grpo term's policy-loss variants (mtprun/losses/grpo.py).
    "gspo_dual_clip_tis": [
        {
            "kind": "grpo",
            "ratio": "sequence",
            "loss_agg": "seq-mean-token-mean",
            "clip_low": 0.5,
            "clip_high": 1.0,
            "clip_c": 1.5,
            "tis_cap": 1.5,
            "kl_coef": 0.1,
        }
    ],
    "cispo_tis_sum_norm": [
        {
            "kind": "grpo",
            "policy_loss": "cispo",
            "tis_cap": 1.2,
            "loss_agg": "seq-mean-token-sum-norm",
            "kl_coef": 0.1,
            "kl_estimator": "k2",
        },
        {"kind": "entropy", "coef": 0.01},
    ],
    "dual_clip": [{"kind": "grpo", "clip_c": 1.2}],
    "gspo_cispo_mtp_distill": [
        {"kind": "grpo", "ratio": "sequence", "policy_loss": "cispo"},
        {"kind": "distill", "teacher": "t", "weight": 0.5},
        {"kind": "mtp", "depth": 1, "target": "soft"},
    ],
}


def make_batch(
    seed: int,
    active: float,
    *,
    n: int,
    h: int,
    v: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> dict:
    """Fresh random inputs; about `active` of the rows under the loss mask, 3 sequences."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, h, generator=gen) * scale).to(device=device, dtype=dtype)

    def vector(scale: float) -> torch.Tensor:
        return (-torch.rand(n, generator=gen) * scale).to(device)

    hidden, weight = matrix(n), matrix(v, 2.0 / h**0.5)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    # Old log-probs near the policy's own: ratios on both sides of every clip bound.
    logp = (hidden.float() @ weight.float().T).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    return {
        "hidden": hidden.requires_grad_(),
        "weight": weight.requires_grad_(),
        "targets": targets,
        "loss_mask": (torch.rand(n, generator=gen) < active).to(device),
        "advantages": torch.randn(n, generator=gen).to(device),
        "old_logprobs": logp + (torch.randn(n, generator=gen) * 0.7).to(device),
        "ref_logprobs": vector(6.0),
        "sampler_logprobs": (torch.randn(n, generator=gen) * 0.5).to(device),  # + old, below
        "mtp_hidden": [matrix(n).requires_grad_() for _ in range(2)],
        "cu_seqlens": torch.tensor([0, n // 4, n // 2 + 3, n]).to(device),
        "teacher_hidden": matrix(n),
        "teacher_weight": matrix(v, 2.0 / h**0.5),
    }


def head_inputs(
    plan: HeadPlan, batch: dict, tp_group: dist.ProcessGroup | None = None
) -> HeadInputs:
    """The batch's inputs that the plan uses (HeadInputs.build rejects the others), checked."""
    args = {k: batch[k] for k in ("targets", "loss_mask", "cu_seqlens")}
    if plan.term("grpo") is not None:
        args.update({k: batch[k] for k in ("advantages", "old_logprobs", "ref_logprobs")})
    if plan.sampler_logprobs:  # near the old log-probs, some beyond a tis_cap
        args["sampler_logprobs"] = batch["old_logprobs"] + batch["sampler_logprobs"]
    if plan.mtp_depths:
        args["mtp_hidden"] = batch["mtp_hidden"][: len(plan.mtp_depths)]
    if plan.term("distill") is not None:
        args.update({k: batch[k] for k in ("teacher_hidden", "teacher_weight")})
    return HeadInputs.build(plan, batch["hidden"], batch["weight"], **args, tp_group=tp_group)


def run(fn, plan: HeadPlan, batch: dict, tp_group: dist.ProcessGroup | None = None, **options):
    """Loss output and the gradients of hidden, weight and the used mtp_hidden."""
    students = [batch["hidden"], batch["weight"], *batch["mtp_hidden"][: len(plan.mtp_depths)]]
    for tensor in students:
        tensor.grad = None
    out = fn(head_inputs(plan, batch, tp_group), **options)
    out.loss.backward()
    grads = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in students]
    return out, grads


def on_cpu(batch: dict) -> dict:
    """A leaf copy of `batch` on the CPU (for the float64 reference)."""

    def move(value):
        if isinstance(value, list):
            return [move(v) for v in value]
        moved = value.detach().cpu()
        return moved.requires_grad_() if value.requires_grad else moved

    return {name: move(value) for name, value in batch.items()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-12))


def assert_matches_reference(fn, plan: HeadPlan, batch: dict, tol: float, **options) -> None:
    """Loss, every metric, logprobs and every gradient of `fn` against the float64 reference."""
    out, grads = run(fn, plan, batch, **options)
    ref, ref_grads = run(reference_head_loss, plan, on_cpu(batch))
    assert torch.isfinite(out.loss.detach())
    loss = float(out.loss.detach())
    assert loss == pytest.approx(float(ref.loss.detach()), rel=tol, abs=tol)
    assert set(out.metrics) == set(plan.metrics)
    for name in plan.metrics:
        expected = float(ref.metrics[name])
        assert float(out.metrics[name]) == pytest.approx(expected, rel=tol, abs=tol), name
    torch.testing.assert_close(
        out.logprobs.double().cpu(), ref.logprobs.double(), rtol=tol, atol=tol
    )
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads, strict=True)):
        if ref_grad.abs().max() == 0:
            assert grad.abs().max() == 0, f"gradient {index} should be zero"
        else:
            assert relative_error(grad, ref_grad) < tol, f"gradient {index}"


def assert_weight_grad_goes_into_main_grad(
    fn, plan: HeadPlan, batch: dict, tol: float | None = None
) -> None:
    """With `weight_main_grad` the weight's gradient times weight_grad_scale is added into that
    buffer (not into weight.grad) for a loss back-propagated times the scale; the other
    gradients are those of the plain call, scaled. `tol`: relative error allowed (None:
    float32 rounding; bf16 weights' plain gradient rounds where main_grad does not)."""
    _, (grad_hidden, grad_weight, *_) = run(fn, plan, batch)
    scale = 0.37
    # Earlier micro batches' sum, O(1) or at the gradient's scale where that is smaller: against
    # an O(1) buffer a float32 gradient of ~1e-5 (a wide vocabulary) would come back with the
    # buffer's rounding only.
    before = torch.randn(batch["weight"].shape, generator=torch.Generator().manual_seed(5))
    before *= min(1.0, float(grad_weight.float().abs().mean()))
    main_grad = before.clone().to(batch["weight"].device)
    inputs = dataclasses.replace(
        head_inputs(plan, batch), weight_main_grad=main_grad, weight_grad_scale=scale
    )
    batch["hidden"].grad = batch["weight"].grad = None
    (scale * fn(inputs).loss).backward()
    assert batch["weight"].grad is None
    pairs = [
        (batch["hidden"].grad, scale * grad_hidden),
        (main_grad.cpu() - before, scale * grad_weight.cpu().float()),
    ]
    for got, want in pairs:
        if tol is None:
            torch.testing.assert_close(got, want)
        else:
            assert relative_error(got, want) < tol
    # Under megatron-core's DDP with the overlapped reduce: its hook gets a dummy, adds nothing
    # more, and marks the weight ready for its bucket's reduce-scatter.
    ready = megatron_ddp_hook(batch["weight"])
    after = main_grad.clone()
    (scale * fn(inputs).loss).backward()
    assert ready == [batch["weight"]] and batch["weight"].grad is None
    assert relative_error(main_grad - after, after - before.to(after.device)) < 1e-5
