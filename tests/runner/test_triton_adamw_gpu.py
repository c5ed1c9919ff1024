"""The trainer's bf16 path steps with `TritonAdamW` (`triton_adamw.py`), which writes the bf16
weights as it steps the float32 master slices: it trains as megatron-core's distributed
optimizer does with its own torch AdamW, its copy into the weights and its clip. CUDA only:
megatron-core's optimizer needs it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("megatron-core's distributed optimizer needs CUDA", allow_module_level=True)

from megatron.core.optimizer import optimizer as megatron_optimizer

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer import clip_in_step, mixed_precision
from mtprun.runner.trainer.trainer import Trainer
from mtprun.runner.trainer.triton_adamw import TritonAdamW, _model_slices

from .conftest import make_recipe, random_packed_batch

pytestmark = pytest.mark.gpu


def _steps(model_dir, steps: int) -> tuple[Trainer, list[float]]:
    recipe = make_recipe(
        model_dir,
        model={"path": str(model_dir), "dtype": "bfloat16"},
        trainer={"lr": 1e-3, "weight_decay": 0.01, "grad_clip": 0.05},
    )
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cuda")
    batch = random_packed_batch(trainer.shape.vocab, [40, 24, 64], seed=0).to("cuda")
    return trainer, [trainer.train_step([batch])["grad_norm"] for _ in range(steps)]


def _weights(trainer: Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shards = trainer.mixed._shards()
    masters = [p.detach().clone() for s in shards for p in mixed_precision._master_params(s)]
    model = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    return masters, model


def _assert_model_weights_are_rounded_masters(shards: list) -> None:
    """The weights the model computes with are the stepped masters, rounded to nearest."""
    for shard in shards:
        for master, model_slice in _model_slices(shard).items():
            assert torch.equal(model_slice, master.detach().to(model_slice.dtype))


@pytest.mark.parametrize("steps", [1, 3])
def test_the_triton_step_trains_as_megatron_cores_adamw(
    megatron_tp1, tiny_qwen3_dir, monkeypatch, steps
):
    trainer, norms = _steps(tiny_qwen3_dir, steps)
    shards = trainer.mixed._shards()
    assert all(isinstance(s.optimizer, TritonAdamW) for s in shards)
    _assert_model_weights_are_rounded_masters(shards)
    masters, model = _weights(trainer)
    # Nothing the Triton step or the folded clip added holds the trainer's optimizer in a
    # reference cycle: dropped, its GPU memory is freed at once, not whenever Python's
    # collector runs.
    gc.disable()
    try:
        dropped = [weakref.ref(shards[0]), weakref.ref(shards[0].optimizer)]
        del trainer, shards
        assert [reference() for reference in dropped] == [None, None]
    finally:
        gc.enable()
    # The reference: megatron-core's torch AdamW (as it builds it), its clip and its copy.
    monkeypatch.setattr(mixed_precision, "step_model_weights_in_adamw", lambda shard, m: None)
    monkeypatch.setattr(mixed_precision, "fold_clipping_into_step", lambda optimizers: None)
    monkeypatch.setattr(
        megatron_optimizer, "clip_grad_by_total_norm_fp32", clip_in_step._megatron_clip
    )
    reference, want_norms = _steps(tiny_qwen3_dir, steps)
    assert not any(isinstance(s.optimizer, TritonAdamW) for s in reference.mixed._shards())
    want_masters, want_model = _weights(reference)
    # One step: the same gradients, masters equal to float32 rounding. Later steps: torch's
    # foreach AdamW rounds its arithmetic otherwise, a few bf16 weights land on the other
    # neighbour, the gradients drift by ~0.1%, and where a gradient is near zero Adam's
    # normalised update (up to lr = 1e-3 a step) may flip sign: 0.3% of one tensor's elements
    # moved 6e-4 apart on an H200.
    rel, tolerance = (1e-6, 1e-6) if steps == 1 else (1e-2, 2e-3)
    assert norms == pytest.approx(want_norms, rel=rel)
    for got, want in zip(masters, want_masters, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    for got, want in zip(model, want_model, strict=True):  # a bf16 ulp where masters straddle
        torch.testing.assert_close(got, want, rtol=8e-3, atol=tolerance)
