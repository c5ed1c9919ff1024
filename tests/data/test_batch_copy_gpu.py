"""A micro batch's copy to the GPU (`PackedBatch.to`, `mtprun.data.device_copy.to_device`) is
queued behind the GPU's work: no synchronization, where torch's copy from pageable host memory
waits for it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mtprun.data.batch import PackedBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _batch(tokens: int) -> PackedBatch:
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, 1000, (tokens,), generator=generator)
    return PackedBatch(
        input_ids=ids,
        targets=ids.roll(-1),
        loss_mask=torch.rand(tokens, generator=generator) > 0.3,
        position_ids=torch.arange(tokens),
        cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32),
        advantages=torch.randn(tokens, generator=generator),
    )


def _synchronizations(copy: Callable[[], Any]) -> tuple[list[str], Any]:
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(8):  # queued GPU work the copy must not wait for
                busy = busy @ busy / 64
            moved = copy()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)], moved


def test_the_pinned_copy_does_not_synchronize_and_moves_every_field() -> None:
    batch = _batch(3001)
    syncs, moved = _synchronizations(lambda: batch.to("cuda"))
    assert syncs == []
    for name in ("input_ids", "targets", "loss_mask", "position_ids", "cu_seqlens", "advantages"):
        assert torch.equal(getattr(moved, name).cpu(), getattr(batch, name)), name
    assert moved.old_logprobs is None


def test_the_pageable_copy_synchronizes() -> None:
    """What the pinned copy avoids (and that the check above would see a synchronization)."""
    syncs, _ = _synchronizations(lambda: _batch(3001).input_ids.to("cuda"))
    assert syncs
