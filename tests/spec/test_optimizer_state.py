"""`trainer.optimizer_state`: the dtype of AdamW's moments under bf16 weights, as the recipe
states it, validate checks it and the memory estimate counts it."""

from __future__ import annotations

import pytest

from mtprun.compiler import HeadPlan
from mtprun.models.shape import ModelShape
from mtprun.preflight.memory import GIB, estimate_trainer_memory
from mtprun.preflight.memory_advice import over_budget_message
from mtprun.spec.parallel import ParallelSection

from .test_memory import PARAMS, SMALL, TOKENS
from .test_model_families import QWEN3_8B


def _estimate(shape=SMALL, dtype="bfloat16", optimizer="adamw", state="bfloat16", **layout):
    return estimate_trainer_memory(
        shape,
        ParallelSection(**layout),
        dtype=dtype,
        micro_batch_tokens=TOKENS,
        optimizer=optimizer,
        optimizer_state=state,
    )


def test_bf16_moments_take_half_the_moment_bytes() -> None:
    memory = _estimate()
    # float32 master weights (4) + bf16 exp_avg and exp_avg_sq (2 + 2), not 4 + 8.
    assert memory.optimizer == 8 * PARAMS
    assert _estimate(state="float32").optimizer == 12 * PARAMS
    assert _estimate(dp=2).optimizer == 4 * PARAMS  # sharded over dp x cp as before
    assert memory.weights == 2 * PARAMS and memory.gradients == 4 * PARAMS  # unchanged
    assert memory.to_dict()["optimizer_state"] == "bfloat16"


def test_only_adamw_on_bf16_weights_has_bf16_moments() -> None:
    sgd = _estimate(optimizer="sgd", state="float32")
    assert sgd.optimizer == 4 * PARAMS and sgd.optimizer_state == "none"
    # float32 weights train with torch.optim and its float32 moments.
    float32 = _estimate(dtype="float32")
    assert float32.optimizer == 8 * PARAMS and float32.optimizer_state == "float32"


def test_qwen3_8b_at_tp2_fits_an_h100_with_bf16_moments() -> None:
    shape = ModelShape.from_hf_config(QWEN3_8B)
    plan = HeadPlan.from_losses([{"kind": "grpo"}], tp_size=2)
    h100 = 79.2 * GIB  # what torch reports of an H100 80GB

    def estimate(state):
        return estimate_trainer_memory(
            shape, ParallelSection(tp=2), dtype="bfloat16", micro_batch_tokens=4096,
            optimizer_state=state, plan=plan,
        )  # fmt: skip

    float32, bf16 = estimate("float32"), estimate("bfloat16")
    # 4.1B parameters a rank: float32 master weights 15.3 GiB, moments 30.5 or 15.3 GiB.
    assert float32.optimizer / GIB == pytest.approx(45.77, abs=0.01)
    assert bf16.optimizer / GIB == pytest.approx(30.51, abs=0.01)
    assert float32.total > h100 > bf16.total + 12 * GIB
    message = over_budget_message(float32, "an H100", 4096)
    assert "optimizer state is the largest part" in message
    assert "try trainer.optimizer_state: bfloat16 (AdamW's moments in 4 bytes, not 8)" in message
    assert "optimizer_state" not in over_budget_message(
        estimate_trainer_memory(
            shape, ParallelSection(tp=2), dtype="bfloat16", micro_batch_tokens=4096,
            optimizer_state="bfloat16", recompute="none",
        ),
        "40 GiB",
        4096,
    )  # fmt: skip


BF16_SMALL = """\
model:
  tiny: {hidden: 128, heads: 2, kv_heads: 1}
  dtype: bfloat16
data: {source: arithmetic}
"""


@pytest.mark.parametrize(
    ("trainer", "complaint"),
    [
        (
            "trainer: {optimizer_state: fp8}",
            "6:28: trainer.optimizer_state: invalid value 'fp8'; allowed: 'float32', 'bfloat16'",
        ),
        (
            "trainer: {optimizer_state: bfloat1}",
            "6:28: trainer.optimizer_state: invalid value 'bfloat1' (did you mean 'bfloat16'?); "
            "allowed: 'float32', 'bfloat16'",
        ),
        (
            "trainer: {optimizer: sgd, optimizer_state: bfloat16}",
            "6:44: trainer.optimizer_state: bfloat16 sets the dtype of AdamW's moments, and "
            "optimizer sgd keeps none (SGD without momentum): drop optimizer_state or use "
            "optimizer: adamw",
        ),
    ],
)
def test_bad_values_are_refused_at_the_value(write_recipe, located, trainer, complaint) -> None:
    path = write_recipe(f"name: t\n{BF16_SMALL}{trainer}\n")
    assert located(path) == [f"{path}:{complaint}"]


def test_bf16_moments_validate(write_recipe, located) -> None:
    path = write_recipe(f"name: t\n{BF16_SMALL}trainer: {{optimizer_state: bfloat16}}\n")
    assert located(path) == []


def test_bf16_moments_on_float32_weights_are_refused(write_recipe, located) -> None:
    recipe = BF16_SMALL.replace("bfloat16", "float32")
    path = write_recipe(f"name: t\n{recipe}trainer: {{optimizer_state: bfloat16}}\n")
    (message,) = located(path)
    assert ":6:28: " in message  # at trainer.optimizer_state's value
    assert "optimizer_state bfloat16 applies to bf16 weights" in message
    assert "model.dtype is float32" in message
