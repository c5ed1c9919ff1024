"""bf16 training on two GPUs (NCCL) against one process that trains both ranks' micro batches:
the same loss and gradient norm every step, and the same weights after three AdamW steps.

- dp = 2, a dense model: DDP's reduce-scatter overlaps the backward and starts for a bucket
  once the last micro batch has handed its hook every gradient (`MegatronMixedPrecision`); the
  ranks train different numbers of micro batches a step (2/1, 3/2, 1/2), as RL steps do, so a
  reduce started before a gradient was in, or a micro batch left out of it, changes the norm.
- dp = 2 with ep = 2, a mixture of experts: the replicas train unequal numbers of micro
  batches, one of them without trained tokens (an overlong rollout masked whole): the short
  replica runs copies of its last micro batch at weight 0 and none skips one, or the other
  rank's all-to-all would wait for a peer that never comes; the untrained micro batch goes
  through the GPU's head-loss engine with no trained row.
Needs two GPUs."""

from __future__ import annotations

import json

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("data parallelism over NCCL needs two GPUs", allow_module_level=True)

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch
from .gloo_pool import gloo_pool
from .qwen3_folders import build_qwen3_moe_folder

pytestmark = pytest.mark.gpu

LENGTHS = [[40, 24, 64], [90], [12, 30], [70, 8], [33], [50, 50], [20, 61], [45], [9, 9, 30]]
# The micro batches (indices into LENGTHS) each rank trains at each of three steps.
DENSE_STEPS = [[[0, 1], [2, 3, 4], [5]], [[6], [7, 8], [0, 3]]]
EXPERT_STEPS = [[[0, 1, 3], [2], [5]], [[6], [7, 4], [3, 1]]]
UNTRAINED = 3  # under ep, its loss mask all False


def _three_steps(model_dir, layout: dict[str, int], steps: list[list[int]], untrained=None):
    recipe = make_recipe(
        model_dir,
        parallel=layout,
        model={"path": str(model_dir), "dtype": "bfloat16"},
        trainer={"optimizer": "adamw", "lr": 1e-3, "grad_clip": 1.0},
    )
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cuda")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batches = [random_packed_batch(vocab, n, seed=i) for i, n in enumerate(LENGTHS)]
    if untrained is not None:
        batches[untrained].loss_mask[:] = False
    metrics = [trainer.train_step([batches[i] for i in step]) for step in steps]
    weights = {name: t.float().cpu() for name, t in trainer.hf_state_dict().items()}
    return metrics, weights


def _rank_job(rank: int, layout: dict[str, int], model_dir, rank_steps, untrained):
    return _three_steps(model_dir, layout, rank_steps[rank], untrained)


def _assert_trains_like_one_process(model_dir, layout, rank_steps, untrained, weight_error):
    ranks = gloo_pool().run(layout, _rank_job, model_dir, rank_steps, untrained)
    both = [left + right for left, right in zip(*rank_steps, strict=True)]
    one, one_weights = _three_steps(model_dir, {}, both, untrained)
    for two, two_weights in ranks:
        for step, (want, got) in enumerate(zip(one, two, strict=True)):
            for name in ("loss", "grad_norm", "tokens", "trained_tokens"):
                assert got[name] == pytest.approx(want[name], rel=5e-3), (step, name)
        # Another summation order may flip the sign of a near-zero gradient, and Adam's first
        # steps move that weight by +-lr: a few elements differ by ~2 lr, the rest by bf16 ulps.
        for name, want in one_weights.items():
            error = float((two_weights[name] - want).norm() / want.norm())
            assert error < weight_error, f"{name}: relative error {error:.2e}"


def test_two_ranks_train_like_one_process(megatron_tp1, tiny_qwen3_dir):
    _assert_trains_like_one_process(tiny_qwen3_dir, {"dp": 2}, DENSE_STEPS, None, 1e-2)


def test_uneven_expert_parallel_replicas_train_like_one_process(megatron_tp1, tokenizer, tmp_path):
    model_dir = build_qwen3_moe_folder(tokenizer, tmp_path, seed=5)
    layout = {"dp": 2, "ep": 2}
    # The tiny MoE's experts see few tokens: more weights near a sign flip than the dense case.
    _assert_trains_like_one_process(model_dir, layout, EXPERT_STEPS, UNTRAINED, 2e-2)
