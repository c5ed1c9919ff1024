"""`grouped_linear` on the CPU (its loop over groups, no Triton): output and gradients against a
float64 loop, and its weight gradient added into main_grad under megatron-core's contract,
checked with megatron-core's own DDP backward hook (which must not add it a second time)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mtprun.kernels.grouped_gemm import grouped_linear

from .megatron_hook import megatron_ddp_hook

COUNTS = [3, 0, 7, 5]
WIDTH_IN, WIDTH_OUT = 6, 10


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    # Under TRITON_INTERPRET=1 the weight gradient would run the Triton kernel: the loop here.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET" not in os.environ


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), WIDTH_IN, generator=g)
    weight = torch.randn(len(COUNTS), WIDTH_OUT, WIDTH_IN, generator=g)
    dy = torch.randn(sum(COUNTS), WIDTH_OUT, generator=g)
    return x, weight, dy, torch.tensor(COUNTS).cumsum(0).to(torch.int32)


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float64 loop: rows of group e through F.linear with weight[e]."""
    return torch.cat([F.linear(rows, weight[e]) for e, rows in enumerate(x.split(COUNTS))])


def test_output_and_gradients_match_a_float64_loop() -> None:
    x, weight, dy, ends = _inputs(0)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    out = grouped_linear(x, weight, ends)
    out.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = _reference(x64, w64)
    want.backward(dy.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(weight.grad[1], torch.zeros_like(weight.grad[1]))  # the empty group


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_weight_gradient_goes_into_main_grad_once(micro_batches: int) -> None:
    x, weight, dy, ends = _inputs(1)
    weight = torch.nn.Parameter(weight)
    start = torch.randn(weight.shape, generator=torch.Generator().manual_seed(2))
    weight.main_grad = start.clone()
    ready = megatron_ddp_hook(weight)
    x = x.requires_grad_()
    for _ in range(micro_batches):
        grouped_linear(x, weight, ends, accumulate_in_main_grad=True).backward(dy)
    w64 = weight.detach().double().requires_grad_()
    _reference(x.detach().double(), w64).backward(dy.double())
    want = start.double() + micro_batches * w64.grad
    torch.testing.assert_close(weight.main_grad.double(), want, rtol=1e-5, atol=1e-5)
    assert weight.grad_added_to_main_grad and weight.grad is None  # the hook dropped the dummy
    assert ready == [weight] * micro_batches  # and marked it ready each time
    x64 = x.detach().double().requires_grad_()
    _reference(x64, weight.detach().double()).backward(dy.double())
    torch.testing.assert_close(x.grad.double(), micro_batches * x64.grad, rtol=1e-5, atol=1e-5)


def test_without_ddp_the_weight_gets_no_gradient() -> None:
    # megatron-core's layer returns None for a main_grad that no DDP hook watches.
    x, weight, dy, ends = _inputs(3)
    weight = torch.nn.Parameter(weight)
    weight.main_grad = torch.zeros(weight.shape)
    grouped_linear(x, weight, ends, accumulate_in_main_grad=True).backward(dy)
    assert weight.grad is None and weight.main_grad.abs().sum() > 0


def test_accumulation_off_or_frozen_leaves_main_grad_alone() -> None:
    x, weight, dy, ends = _inputs(4)
    weight = torch.nn.Parameter(weight)
    weight.main_grad = torch.zeros(weight.shape)
    grouped_linear(x, weight, ends).backward(dy)  # off: a normal gradient
    assert weight.grad is not None and not weight.main_grad.any()
    frozen = weight.detach().clone()
    frozen.main_grad = torch.zeros(weight.shape)
    x = x.requires_grad_()
    grouped_linear(x, frozen, ends, accumulate_in_main_grad=True).backward(dy)
    assert x.grad is not None and not frozen.main_grad.any()
