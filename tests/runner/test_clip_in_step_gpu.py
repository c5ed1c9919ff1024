"""The trainer's bf16 path (megatron-core's distributed optimizer) with gradient clipping
folded into the AdamW step (`clip_in_step`) trains as with megatron-core's own clip, which
scales the gradients first, with float32 and bfloat16 moments (`TritonAdamW`). CUDA only:
megatron-core's optimizer needs it."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("megatron-core's distributed optimizer needs CUDA", allow_module_level=True)

from megatron.core.optimizer import optimizer as megatron_optimizer

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer import clip_in_step, mixed_precision
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch

pytestmark = pytest.mark.gpu


def _three_clipped_steps(model_dir, moments: str) -> tuple[list[float], list, list]:
    recipe = make_recipe(
        model_dir,
        model={"path": str(model_dir), "dtype": "bfloat16"},
        trainer={"lr": 1e-3, "grad_clip": 0.05, "optimizer_state": moments},
    )
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cuda")
    batch = random_packed_batch(trainer.shape.vocab, [40, 24, 64], seed=0).to("cuda")
    norms = [trainer.train_step([batch])["grad_norm"] for _ in range(3)]
    shards = trainer.mixed._shards()
    divisors = [getattr(shard.optimizer, "grad_scale", None) for shard in shards]
    masters = [p.detach().clone() for s in shards for p in mixed_precision._master_params(s)]
    return norms, divisors, masters


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_a_folded_clip_trains_as_megatron_cores(megatron_tp1, tiny_qwen3_dir, moments, monkeypatch):
    norms, divisors, weights = _three_clipped_steps(tiny_qwen3_dir, moments)
    assert min(norms) > 0.05 and all(d is not None and float(d) > 1 for d in divisors)
    # The reference: megatron-core's own clip, which scales the gradients before the step.
    monkeypatch.setattr(mixed_precision, "fold_clipping_into_step", lambda optimizers: None)
    monkeypatch.setattr(
        megatron_optimizer, "clip_grad_by_total_norm_fp32", clip_in_step._megatron_clip
    )
    want_norms, unfolded, want_weights = _three_clipped_steps(tiny_qwen3_dir, moments)
    assert all(d is None for d in unfolded)
    assert norms == pytest.approx(want_norms, rel=1e-4)
    # float32 master weights; bf16 moments round stochastically on the values' own bits,
    # which a divisor and a multiplier may leave one ulp apart.
    tolerance = 1e-6 if moments == "float32" else 1e-4
    for got, want in zip(weights, want_weights, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
