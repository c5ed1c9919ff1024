"""The Triton grouped weight-gradient kernel (`grouped_wgrad_`) against a float64 loop, and
`grouped_linear`'s accumulation into main_grad through it. Runs on CUDA, or on CPU under the
Triton interpreter (`test_triton_head_loss.py` runs this module in a process with
TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from .elementwise import triton_device

DEVICE = triton_device()

from mtprun.kernels.grouped_gemm import grouped_linear  # noqa: E402 (after the skip)
from mtprun.kernels.triton.grouped_wgrad import grouped_wgrad_  # noqa: E402

# bf16 products are exact in float32 and float32 operands run in full float32: what differs
# from float64 is the float32 sum over a group's rows, relative to the largest entry.
TOLERANCE = 2e-5


def _ends(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(DEVICE, torch.int32)


def _reference(out, a, b, counts) -> torch.Tensor:
    """out + a_e^T b_e per group, in float64 on the CPU."""
    want, start = out.double().cpu(), 0
    for e, rows in enumerate(counts):
        want[e] += a[start : start + rows].double().cpu().T @ b[start : start + rows].double().cpu()
        start += rows
    return want


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=TOLERANCE * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("counts", "m", "n", "extra_rows"),
    [
        ([5, 0, 70, 130, 0], 130, 70, 3),  # empty groups, partial tiles, rows past ends[-1]
        ([64, 64], 128, 256, 0),  # whole tiles and whole row blocks
        ([1, 2], 1, 3, 0),
        ([0, 0, 0], 16, 8, 2),  # no group has rows: out unchanged
    ],
)
def test_accumulates_onto_out_like_a_float64_loop(counts, m, n, extra_rows, dtype) -> None:
    g = torch.Generator().manual_seed(sum(counts) + m + n)
    rows = sum(counts) + extra_rows
    a = torch.randn(rows, m, generator=g).to(DEVICE, dtype)
    b = torch.randn(rows, n, generator=g).to(DEVICE, dtype)
    out = torch.randn(len(counts), m, n, generator=g).to(DEVICE)
    want = _reference(out, a, b, counts)
    grouped_wgrad_(out, a, b, _ends(counts))
    _assert_close(out, want)


def test_writes_into_a_strided_view_of_a_flat_buffer() -> None:
    # megatron-core's main_grad is a view into DDP's one flat float32 buffer, at an offset.
    counts, m, n = [3, 9], 20, 12
    g = torch.Generator().manual_seed(7)
    buffer = torch.randn(5 + 2 * m * n + 4, generator=g).to(DEVICE)
    out = buffer[5 : 5 + 2 * m * n].view(2, m, n)
    before = buffer.clone()
    a = torch.randn(12, m, generator=g).to(DEVICE, torch.bfloat16)
    b = torch.randn(12, n, generator=g).to(DEVICE, torch.bfloat16)
    want = _reference(out, a, b, counts)
    grouped_wgrad_(out, a, b, _ends(counts))
    _assert_close(out, want)
    assert torch.equal(buffer[:5], before[:5]) and torch.equal(buffer[-4:], before[-4:])


def test_grouped_linear_adds_its_weight_gradient_into_main_grad() -> None:
    counts, width_in, width_out = [4, 0, 9], 24, 40
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), width_in, generator=g).to(DEVICE, torch.bfloat16)
    weight = torch.randn(3, width_out, width_in, generator=g).to(DEVICE, torch.bfloat16)
    weight = torch.nn.Parameter(weight)
    start = torch.randn(weight.shape, generator=g).to(DEVICE)
    weight.main_grad = start.clone()
    weight.grad_added_to_main_grad = False  # as megatron-core's DDP marks it
    dy = torch.randn(sum(counts), width_out, generator=g).to(DEVICE, torch.bfloat16)
    grouped_linear(x, weight, _ends(counts), accumulate_in_main_grad=True).backward(dy)
    _assert_close(weight.main_grad, _reference(start, dy, x, counts))
    assert weight.grad_added_to_main_grad
    assert weight.grad.shape == weight.shape and weight.grad.dtype == torch.bfloat16
