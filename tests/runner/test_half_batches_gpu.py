"""Expert parallelism on two GPUs (dp = 2, ep = 2, NCCL, bf16): each micro batch's two halves
on two CUDA streams (`HalfBatchStreams`, the trainer's default there) train like the same
micro batches run whole. Both halves add into the same weights' float32 main gradients in
backward and DDP's reduce-scatter starts during it: an add that raced another, or a reduce
that started before the second half's add, changes the gradient norm and the weights. Needs
two GPUs."""

from __future__ import annotations

import json

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("expert parallelism over NCCL needs two GPUs", allow_module_level=True)

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch
from .gloo_pool import gloo_pool
from .qwen3_folders import build_qwen3_moe_folder

pytestmark = pytest.mark.gpu

LENGTHS = [[40, 24, 64], [90, 30], [12, 30], [70, 8], [33, 17], [50, 50], [20, 61], [45, 5]]
# The micro batches (indices into LENGTHS) each rank trains at each of three steps.
RANK_STEPS = [[[0, 1], [2, 3, 4], [5]], [[6], [7, 0], [1, 3]]]


def _rank_job(rank: int, layout: dict[str, int], model_dir, halves: bool):
    recipe = make_recipe(
        model_dir,
        parallel=layout,
        model={"path": str(model_dir), "dtype": "bfloat16"},
        trainer={"optimizer": "adamw", "lr": 1e-3, "grad_clip": 1.0},
    )
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cuda")
    assert trainer.model.half_batches is not None  # on by default under ep on a GPU
    if not halves:
        trainer.model.half_batches = None
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batches = [random_packed_batch(vocab, n, seed=i) for i, n in enumerate(LENGTHS)]
    steps = RANK_STEPS[rank]
    metrics = [trainer.train_step([batches[i] for i in step]) for step in steps]
    weights = {name: t.float().cpu() for name, t in trainer.hf_state_dict().items()}
    return metrics, weights


def test_halves_on_two_streams_train_like_whole_micro_batches(megatron_tp1, tokenizer, tmp_path):
    model_dir = build_qwen3_moe_folder(tokenizer, tmp_path, seed=3)
    layout = {"dp": 2, "ep": 2}
    halved = gloo_pool().run(layout, _rank_job, model_dir, True)
    whole = gloo_pool().run(layout, _rank_job, model_dir, False)
    for (got, got_weights), (want, want_weights) in zip(halved, whole, strict=True):
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            for name in ("loss", "grad_norm", "trained_tokens"):
                assert a[name] == pytest.approx(b[name], rel=5e-3), (step, name)
        # The halves sum their gradients in another order: a near-zero gradient may flip
        # sign and Adam's first steps move that weight by +-lr; the rest differ by bf16 ulps.
        for name, w in want_weights.items():
            error = float((got_weights[name] - w).norm() / w.norm())
            assert error < 1e-2, f"{name}: relative error {error:.2e}"
