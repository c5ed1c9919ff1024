"""The Triton head loss under the Triton interpreter (CPU) against the float64 reference.

TRITON_INTERPRET must be set before the kernels are decorated, so this module sets it before
importing them (and reloads them if another test module imported them compiled).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch

from mtprun.compiler import HeadPlan

from .test_triton_cases import (
    PLANS,
    arguments,
    assert_matches_reference,
    make_batch,
    run,
)


def _load_interpreted():
    for name in ("coefficients", "rows", "launch", "engine", "head_loss"):
        module = sys.modules.get(f"mtprun.kernels.triton.{name}")
        if module is not None:
            importlib.reload(module)
    from mtprun.kernels.triton import head_loss, launch, rows

    assert type(rows.head_rows_kernel).__name__ == "InterpretedFunction"
    return head_loss.head_loss_triton, launch


head_loss_triton, launch = _load_interpreted()

SHAPE = {"n": 32, "h": 16, "v": 300}
BLOCK_V = 128  # three vocab tiles, the last one partial
SEVEN_ROW_CHUNKS = 7 * SHAPE["v"] * 4 * 4  # teachers of MTP rows fall in the next chunk


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(launch, "MAX_BLOCK_V", BLOCK_V)


@pytest.mark.parametrize(
    ("name", "active"), [*((name, 0.6) for name in sorted(PLANS)), ("sft", 1.0), ("mtp_soft", 1.0)]
)
def test_matches_reference_float32(name: str, active: float) -> None:
    plan = HeadPlan.from_losses(PLANS[name])
    batch = make_batch(len(name) * 7 + int(active * 10), active, **SHAPE)
    assert_matches_reference(head_loss_triton, plan, batch, 2e-4, chunk_bytes=SEVEN_ROW_CHUNKS)


@pytest.mark.parametrize("name", ["sft", "grpo", "mtp_soft"])
def test_matches_reference_bfloat16(name: str) -> None:
    plan = HeadPlan.from_losses(PLANS[name])
    batch = make_batch(7, 0.5, dtype=torch.bfloat16, **SHAPE)
    assert_matches_reference(head_loss_triton, plan, batch, 3e-2)


def test_sparse_mask_and_uncompacted_rows_agree() -> None:
    batch = make_batch(11, 0.1, **SHAPE)
    for compact in (True, False):
        plan = HeadPlan.from_losses(PLANS["grpo"], compact_mask=compact)
        assert_matches_reference(head_loss_triton, plan, batch, 2e-4)


def test_all_masked_batch_gives_zero_loss_and_gradients() -> None:
    plan = HeadPlan.from_losses(PLANS["mtp_soft"])
    out, grads = run(head_loss_triton, plan, make_batch(3, 0.0, **SHAPE))
    assert float(out.loss.detach()) == 0.0
    assert all(float(m) == 0.0 for m in out.metrics.values())
    assert all(bool((g == 0).all()) for g in grads)
    assert bool((out.logprobs == 0).all())


def test_loss_scale_reaches_gradients() -> None:
    plan = HeadPlan.from_losses(PLANS["sft"])
    batch = make_batch(5, 0.7, **SHAPE)
    out = head_loss_triton(batch["hidden"], batch["weight"], plan, **arguments(plan, batch))
    (3.0 * out.loss).backward()
    scaled = batch["hidden"].grad.clone()
    _, grads = run(head_loss_triton, plan, batch)
    torch.testing.assert_close(scaled, 3.0 * grads[0])


def test_missing_advantages_is_rejected_with_the_argument_name() -> None:
    plan = HeadPlan.from_losses(PLANS["grpo"])
    batch = make_batch(1, 0.5, **SHAPE)
    with pytest.raises(ValueError, match="advantages"):
        head_loss_triton(
            batch["hidden"],
            batch["weight"],
            plan,
            targets=batch["targets"],
            loss_mask=batch["loss_mask"],
        )
