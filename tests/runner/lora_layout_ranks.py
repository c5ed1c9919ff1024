"""The trainer ranks of test_lora_layouts.py, run in `gloo_pool`'s workers, in a module of
their own: a spawned process imports the module of the function it runs, and this one imports
only what a trainer rank needs (the test modules import the runner tests' conftest, whose
tiny-model builders import transformers' auto classes: ~4 CPU-seconds more in each process).
Recipes and batches come built from the test process."""

from __future__ import annotations

from typing import Any

from mtprun.compiler import compile_recipe
from mtprun.models.lora import is_adapter
from mtprun.runner.trainer.trainer import Trainer


def train(job: dict[str, Any], batch_ids: list[int]) -> dict[str, Any]:
    """Three steps of `job`'s recipe on its micro batches `batch_ids` in an initialised
    process: what this rank reports (its own count of adapter parameters; the adapters and
    merged weights gathered; the log-probs of the first micro batch)."""
    recipe, batches = job["recipe"], job["batches"]
    trainer = Trainer(recipe, job["model_dir"], compile_recipe(recipe), "cpu")
    metrics = [trainer.train_step([batches[i] for i in batch_ids]) for _ in range(3)]
    count = sum(p.numel() for n, p in trainer.model.named_parameters() if is_adapter(n))
    return {
        "metrics": metrics,
        "logprobs": trainer.logprobs(batches[:1]),
        "adapters": trainer.adapter_state_dict(),
        "merged": trainer.hf_state_dict(),
        "count": count,
    }


def rank_job(rank: int, layout: dict[str, int], job: dict[str, Any]) -> dict[str, Any]:
    """Rank `rank` of `job`'s layout in the shared worker pool's initialised process group
    (`gloo_pool.run`): data-parallel replicas split the step's micro batches; TP, CP ranks
    and stages share them."""
    from megatron.core import parallel_state

    batch_ids = [parallel_state.get_data_parallel_rank()] if layout.get("dp") == 2 else [0, 1]
    return train(job, batch_ids)
