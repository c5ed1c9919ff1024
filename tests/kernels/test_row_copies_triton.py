"""The Triton kernel of `sum_copies` against a float64 loop, forward and backward, at several
shapes, K and dtypes. Runs on CUDA, or on CPU under the Triton interpreter
(`test_triton_head_loss.py` runs this module in a process with TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from .elementwise import TOLERANCE, triton_device

DEVICE = triton_device()

from mtprun.kernels.row_copies import copy_rows, sum_copies  # noqa: E402 (after the skip)

from .row_copies_cases import random_plan, reference_sum  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k", "width"), [(50, 8, 1100), (9, 3, 64), (4, 1, 5)])
def test_sum_and_its_gradient_match_a_float64_loop(rows, k, width, dtype) -> None:
    plan = random_plan(rows, k, seed=rows * k, device=DEVICE)
    g = torch.Generator().manual_seed(width + k)
    y = torch.randn(plan.sources.numel(), width, generator=g).to(DEVICE, dtype).requires_grad_()
    out = sum_copies(y, plan)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), reference_sum(y, plan), rtol=rtol, atol=atol)
    grad = torch.randn(rows, width, generator=g).to(DEVICE, dtype)
    out.backward(grad)
    assert torch.equal(y.grad, grad[plan.sources])
    x = grad.clone().requires_grad_()
    copy_rows(x, plan).backward(y.detach())
    torch.testing.assert_close(x.grad.double().cpu(), reference_sum(y, plan), rtol=rtol, atol=atol)
