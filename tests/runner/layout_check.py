"""Two AdamW steps of a model under a parallel layout against one process: the check of the
Qwen3-MoE, GLM-4.5 and Qwen3.5 layout tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer.trainer import Trainer
from mtprun.spec.parallel import ParallelSection

from .conftest import make_recipe, random_packed_batch
from .gloo_pool import gloo_pool

ADAMW = {"optimizer": "adamw", "lr": 1e-3}


def layout_batches(vocab: int) -> list:
    """The two micro batches of `two_adamw_steps`: data-parallel replica r trains batch r."""
    return [random_packed_batch(vocab, [9, 14, 6], 8), random_packed_batch(vocab, [20, 4], 9)]


def two_adamw_steps(model_dir: Path, layout: dict[str, int], batch_ids=(0, 1)):
    """Two AdamW steps on micro batches `batch_ids` in an initialised process: each step's
    metrics and the gathered weights after them. The second step's update reads the moments
    the first one left (the first one's is sign-like), and the weights after it are compared:
    a third step would check nothing more."""
    recipe = make_recipe(model_dir, parallel=layout, trainer=ADAMW)
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")
    batches = [layout_batches(trainer.shape.vocab)[i] for i in batch_ids]
    metrics = [trainer.train_step(batches) for _ in range(2)]
    return metrics, trainer.hf_state_dict()


def _layout_job(rank: int, layout: dict[str, int], model_dir: Path):
    """Rank `rank` of `layout` (a pool worker): each of two data-parallel replicas trains its
    own micro batch, without dp every rank both; the last rank (the last pipeline stage)
    returns its result."""
    from mtprun.runner.trainer.parallel import data_parallel_replica

    parallel = ParallelSection(**layout)
    batch_ids = [data_parallel_replica(rank, parallel)] if parallel.dp == 2 else (0, 1)
    result = two_adamw_steps(model_dir, layout, batch_ids=batch_ids)
    return result if rank == parallel.world_size - 1 else None


def check_trains_like_one_process(
    model_dir: Path, layout: dict[str, int], one_process: dict[Any, Any]
) -> list[dict[str, Any]]:
    """Loss and grad norm of 2 AdamW steps within 1e-4 of one process, and the gathered
    weights equal (a misplaced expert or stage would differ by whole weights; Adam's division
    by tiny second moments leaves ~1e-5 between reduction orders). `one_process`: the module's
    cache of one-process runs by model folder, filled here (this process must be initialised
    as one process: the `megatron_tp1` fixture). Returns the layout's last rank's metrics of
    each step."""
    two, two_weights = gloo_pool().run(layout, _layout_job, model_dir)[-1]
    if model_dir not in one_process:
        one_process[model_dir] = two_adamw_steps(model_dir, {})
    one, one_weights = one_process[model_dir]
    for step1, step2 in zip(one, two, strict=True):
        for name in ("loss", "grad_norm"):
            assert step2[name] == pytest.approx(step1[name], rel=1e-4), name
    assert two_weights.keys() == one_weights.keys()
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, rtol=1e-3, atol=1e-4)
    return two
