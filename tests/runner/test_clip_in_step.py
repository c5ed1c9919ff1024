"""Gradient clipping folded into the AdamW step (`clip_in_step`), on CPU with torch's fused
AdamW: clipping through megatron-core's clip function, now folded, steps exactly as scaling
the gradients first; an unclipped step leaves no divisor behind; the gradients themselves are
not touched. The trainer's bf16 path on a GPU: test_clip_in_step_gpu.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from megatron.core.optimizer import optimizer as megatron_optimizer

from mtprun.runner.trainer.clip_in_step import fold_clipping_into_step


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(33,), (4, 7), (1,)]]


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_a_folded_clip_steps_as_scaling_the_gradients_first(max_norm: float) -> None:
    folded, reference = _params(0), _params(0)
    options = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    optimizer = torch.optim.AdamW(folded, **options)
    expected = torch.optim.AdamW(reference, **options)
    fold_clipping_into_step([optimizer])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in folded]
        norm = float(torch.linalg.vector_norm(torch.cat([x.flatten() for x in grads])))
        for param, ref, grad in zip(folded, reference, grads, strict=True):
            param.grad, ref.grad = grad.clone(), grad * min(1.0, max_norm / (norm + 1e-6))
        megatron_optimizer.clip_grad_by_total_norm_fp32(folded, max_norm, norm)
        assert (optimizer.grad_scale is None) == (max_norm > norm)
        assert all(torch.equal(p.grad, x) for p, x in zip(folded, grads, strict=True))
        optimizer.step()
        expected.step()
        for param, ref in zip(folded, reference, strict=True):
            torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-7)


def test_the_fold_leaves_no_reference_cycle() -> None:
    # The parameters name their optimizer, which holds them: a dropped optimizer (and its
    # Adam state) must go at once, not when Python's collector runs.
    params = _params(2)
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    fold_clipping_into_step([optimizer])
    dropped = weakref.ref(optimizer)
    gc.disable()
    try:
        del optimizer
        assert dropped() is None
    finally:
        gc.enable()
