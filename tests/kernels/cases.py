"""Random head-loss problems and the comparison against the float64 reference."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mtprun.compiler import HeadPlan
from mtprun.kernels import HeadInputs, HeadLossOutput


@dataclass
class Problem:
    """One random batch: differentiable leaves plus the other arguments of HeadInputs.build."""

    plan: HeadPlan
    hidden: torch.Tensor
    weight: torch.Tensor
    mtp_hidden: list[torch.Tensor]
    kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None

    def leaves(self) -> list[torch.Tensor]:
        return [self.hidden, self.weight, *self.mtp_hidden]

    def clone(self, dtype: torch.dtype | None = None) -> Problem:
        """Fresh leaves (optionally cast, e.g. float64 for the reference), same values."""
        hidden, weight, *mtp = (
            t.detach().to(dtype or t.dtype).requires_grad_() for t in self.leaves()
        )
        return Problem(self.plan, hidden, weight, mtp, dict(self.kwargs), self.seed)

    def inputs(self, tp_group: dist.ProcessGroup | None = None) -> HeadInputs:
        """The problem as checked head-loss inputs."""
        mtp = {"mtp_hidden": self.mtp_hidden} if self.mtp_hidden else {}
        return HeadInputs.build(
            self.plan, self.hidden, self.weight, **self.kwargs, **mtp, tp_group=tp_group
        )

    def call(
        self,
        fn: Callable[..., HeadLossOutput],
        tp_group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> HeadLossOutput:
        """`fn` (head_loss or the reference) on the problem's inputs."""
        return fn(self.inputs(tp_group), **options)


def make_problem(
    terms: list[dict[str, Any]],
    *,
    rows: int = 61,
    hidden_size: int = 16,
    vocab: int = 53,
    active: float = 0.6,
    dtype: torch.dtype = torch.float32,
    seq_lens: list[int] | None = None,
    plan_options: dict[str, Any] | None = None,
    seed: int | None = None,
) -> Problem:
    """Fresh random inputs, seeded from the OS unless `seed` is given (failures name the seed
    to pass here to reproduce them)."""
    gen = torch.Generator()
    if seed is None:
        seed = gen.seed()
    gen.manual_seed(seed)
    plan = HeadPlan.from_losses(terms, **(plan_options or {}))

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.6).to(dtype).requires_grad_()

    num_active = round(active * rows)
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[torch.randperm(rows, generator=gen)[:num_active]] = True
    lens = seq_lens or _random_lengths(rows, gen)
    kwargs: dict[str, Any] = {
        "targets": torch.randint(0, vocab, (rows,), generator=gen),
        "loss_mask": mask,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
    }
    if plan.term("grpo") is not None:
        kwargs["advantages"] = torch.randn(rows, generator=gen)
        kwargs["old_logprobs"] = -torch.rand(rows, generator=gen) * 4 - 2
        kwargs["ref_logprobs"] = -torch.rand(rows, generator=gen) * 4 - 2
    if plan.sampler_logprobs:  # near the old ones, some beyond a tis_cap of 1.5
        old = kwargs["old_logprobs"]
        kwargs["sampler_logprobs"] = old + torch.randn(rows, generator=gen)
    if plan.term("distill") is not None:
        kwargs["teacher_hidden"] = torch.randn(rows, 8, generator=gen).to(dtype)
        kwargs["teacher_weight"] = torch.randn(vocab, 8, generator=gen).to(dtype)
    mtp = [randn(rows, hidden_size) for _ in plan.mtp_depths]
    return Problem(plan, randn(rows, hidden_size), randn(vocab, hidden_size), mtp, kwargs, seed)


def assert_matches_reference(
    out: HeadLossOutput,
    ref: HeadLossOutput,
    problem: Problem,
    reference: Problem,
    *,
    grad_tol: float = 1e-4,
) -> None:
    """Loss, metrics and logprobs to 1e-4 (relative), every leaf's gradient to grad_tol
    (max error over max magnitude)."""
    assert set(out.metrics) == set(problem.plan.metrics)
    assert set(ref.metrics) <= set(out.metrics)
    where = f"(make_problem seed={problem.seed})"
    _close(f"loss {where}", out.loss, ref.loss)
    for name, value in ref.metrics.items():
        _close(f"metric {name} {where}", out.metrics[name], value)
    _close(f"logprobs {where}", out.logprobs, ref.logprobs)
    (out.loss * 1.7).backward()  # a grad_output other than 1 checks the backward scaling
    (ref.loss * 1.7).backward()
    names = ["hidden", "weight", *(f"mtp_hidden[{i}]" for i in range(len(problem.mtp_hidden)))]
    for name, ours, theirs in zip(names, problem.leaves(), reference.leaves(), strict=True):
        expected = theirs.grad if theirs.grad is not None else torch.zeros_like(theirs)
        assert ours.grad is not None, f"no gradient reached {name}"
        assert ours.grad.dtype == ours.dtype, f"grad of {name} has dtype {ours.grad.dtype}"
        error = (ours.grad.double() - expected).abs().max()
        scale = expected.abs().max().clamp(min=1e-6)
        assert error <= grad_tol * scale, (
            f"grad {name} {where}: max error {error:.3g} vs max {scale:.3g}"
        )


def _close(name: str, ours: torch.Tensor, expected: torch.Tensor) -> None:
    ours = ours.detach().double()
    assert torch.isfinite(ours).all(), f"{name} is not finite: {ours}"
    tol = 1e-4 * (1 + expected.abs().max())
    error = (ours - expected).abs().max()
    assert error <= tol, f"{name}: {ours} vs reference {expected} (error {error:.3g})"


def _random_lengths(rows: int, gen: torch.Generator) -> list[int]:
    cuts = sorted(torch.randperm(rows - 1, generator=gen)[:3].add(1).tolist())
    bounds = [0, *cuts, rows]
    return [b - a for a, b in itertools.pairwise(bounds)]
