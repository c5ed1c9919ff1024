"""`copy_rows` / `sum_copies` (the MoE dispatcher's permute and unpermute) on CPU: each the
other's adjoint (float64 gradcheck), against a loop in float64 at several shapes and dtypes.
The Triton kernel's tests are test_row_copies_triton.py."""

from __future__ import annotations

import pytest
import torch

from mtprun.kernels.row_copies import copy_rows, sum_copies

from .row_copies_cases import random_plan, reference_sum


@pytest.mark.parametrize(("rows", "k", "width"), [(7, 3, 5), (40, 8, 16), (1, 1, 3)])
def test_each_is_the_others_gradient_in_float64(rows, k, width) -> None:
    plan = random_plan(rows, k, seed=rows + k)
    g = torch.Generator().manual_seed(width)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(plan.sources.numel(), width, generator=g, dtype=torch.float64)
    y.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: copy_rows(t, plan), (x,))
    assert torch.autograd.gradcheck(lambda t: sum_copies(t, plan), (y,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k", "width"), [(64, 8, 48), (33, 2, 7), (0, 4, 8)])
def test_match_a_float64_loop(rows, k, width, dtype) -> None:
    plan = random_plan(rows, k, seed=3 * rows + k)
    g = torch.Generator().manual_seed(rows * width + 1)
    x = torch.randn(rows, width, generator=g).to(dtype).requires_grad_()
    copies = copy_rows(x, plan)
    assert torch.equal(copies, x.detach()[plan.sources])
    out = sum_copies(copies * 1.5, plan)
    assert out.dtype == dtype and out.shape == (rows, width)
    # Each row's copies sum in float32 and round once.
    want = reference_sum(copies.detach() * 1.5, plan)
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)
    grad = torch.randn(rows, width, generator=g).to(dtype)
    out.backward(grad)
    counts = (plan.slots >= 0).sum(1, keepdim=True).double()
    torch.testing.assert_close(
        x.grad.double(), 1.5 * counts * grad.double(), rtol=tolerance, atol=tolerance
    )
