"""The torch stand-ins for Apex's kernels against float64 references: the multi-tensor l2norm
and scale megatron-core's optimizer calls, and the weight-gradient GEMM that accumulates into
a main gradient."""

from __future__ import annotations

import pytest
import torch

from mtprun.runner.trainer.apex_standins import _l2norm, _scale, _wgrad_accum


def _tensors(g: torch.Generator, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((7, 3), (11,), (2, 5, 4))]


def test_l2norm_is_the_norm_of_every_tensor_of_every_list():
    g = torch.Generator().manual_seed(0)
    lists = [_tensors(g, torch.float32), _tensors(g, torch.float32)]
    norm, per_tensor = _l2norm(2048, torch.zeros(1, dtype=torch.int), lists, False)
    want = torch.cat([t.double().flatten() for tensors in lists for t in tensors]).norm()
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(norm.double(), want.reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_scale_in_place_and_into_another_dtype(scale):
    g = torch.Generator().manual_seed(1)
    src = _tensors(g, torch.float32)
    want = [t.double() * scale for t in src]
    want_bf16 = [(t * scale).to(torch.bfloat16) for t in src]  # float32 product, then rounded
    flag = torch.zeros(1, dtype=torch.int)
    bf16 = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    _scale(2048, flag, [src, bf16], scale)
    _scale(2048, flag, [src, src], scale)
    for got, expected in zip(src, want, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-7)
    for got, expected in zip(bf16, want_bf16, strict=True):
        assert torch.equal(got, expected)


def _wgrad_case(dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 16, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(3, 4, 8, generator=g).to(device=device, dtype=dtype)
    main_grad = torch.randn(8, 16, generator=g).to(device)
    want = main_grad.double() + dy.double().flatten(0, 1).t() @ x.double().flatten(0, 1)
    _wgrad_accum(x, dy, main_grad)
    return main_grad.double(), want


def test_wgrad_accumulates_into_a_main_grad_of_its_dtype():
    got, want = _wgrad_case(torch.float32, "cpu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float32-output GEMM is CUDA's")
def test_wgrad_of_bf16_operands_accumulates_in_float32():
    got, want = _wgrad_case(torch.bfloat16, "cuda")
    torch.testing.assert_close(got, want.to(got.device), rtol=1e-5, atol=1e-4)
