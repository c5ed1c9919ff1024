"""The trainer ranks of test_lora_layouts.py, in a module of their own: a spawned process
imports the module of the function it runs, and this one imports only what a trainer rank
needs (the test modules import the runner tests' conftest, whose tiny-model builders import
transformers' auto classes: ~4 CPU-seconds more in each process). Recipes and batches come
built from the test process."""

from __future__ import annotations

from typing import Any

import torch

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


def process(rank: int, jobs: dict[str, dict[str, Any]], ports: list[int], out_path) -> None:
    """Rank `rank` of every job's layout, one after another (each its own process group and
    Megatron groups, torn down before the next); the last rank (the last pipeline stage,
    where the losses are) saves each job's report."""
    from megatron.core import parallel_state

    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel

    reports = {}
    for (name, job), port in zip(jobs.items(), ports, strict=True):
        layout = job["recipe"].parallel
        init_parallel(layout, rank, layout.world_size, "127.0.0.1", port)
        try:
            # Data-parallel replicas split the step's micro batches; TP, CP ranks and stages
            # share them.
            batch_ids = [parallel_state.get_data_parallel_rank()] if layout.dp == 2 else [0, 1]
            reports[name] = train(job, batch_ids)
        except Exception as e:
            e.add_note(f"in layout {name}")
            raise
        finally:
            destroy_parallel()
    if rank == 1:
        torch.save(reports, out_path)
