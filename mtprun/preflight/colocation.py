"""`resources.placement: colocate` held against the recipe and the GPU it runs on.

A colocated GPU holds a trainer rank and a rollout engine, which take turns:

- generation: the trainer rank holds its weights (optimizer state on the host, gradients
  released); the engine its weights, CUDA graphs and KV cache;
- training: the trainer rank holds what its step needs (the trainer's estimate); the engine,
  asleep, its CUDA context;
- weight sync: the trainer rank holds its weights, and a part of the model at a time gathered
  and packed into the CUDA IPC buckets; the engine its weights and its copy of that part (the
  KV cache wakes after). The largest part is the first (`sync_part_params`).

`colocated_memory` counts each phase's bytes; with `resources.gpu_memory_gib` set, validate
refuses a layout whose largest phase does not fit, before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mtprun.models.shape import LAYERS_PER_PART, ModelShape
from mtprun.preflight.memory import (
    GIB,
    layer_params,
    moe_layer_params,
    parameters,
    recipe_trainer_memory,
)
from mtprun.preflight.model_shape import recipe_shape
from mtprun.preflight.rules import PREFLIGHT_RULES
from mtprun.spec.recipe import Recipe
from mtprun.spec.resources import weight_transfer_method
from mtprun.spec.rules import Issue

rule = PREFLIGHT_RULES.rule

CONTEXT_BYTES = GIB // 2  # one process's CUDA context, cuBLAS and NCCL workspaces
MIN_KV_CACHE_BYTES = 1 * GIB  # the least KV cache worth generating with
HEADROOM_BYTES = 2 * GIB  # what a colocated engine leaves free (vllm_compat)


@dataclass(frozen=True)
class ColocatedMemory:
    """Bytes on one colocated GPU in each phase (see the module docstring)."""

    generation: int
    training: int
    sync: int

    def phases(self) -> dict[str, int]:
        return {"generation": self.generation, "training": self.training, "sync": self.sync}

    def largest(self) -> tuple[str, int]:
        return max(self.phases().items(), key=lambda item: item[1])


def colocated_memory(recipe: Recipe) -> ColocatedMemory | str:
    """Each phase's bytes on the most loaded colocated GPU, or why they cannot be counted."""
    trainer = recipe_trainer_memory(recipe)
    shape = recipe_shape(recipe)
    if isinstance(trainer, str):
        return trainer
    if isinstance(shape, str):
        return shape
    width = 2 if recipe.model.dtype == "bfloat16" else 4
    engine_weights = parameters(shape) * width
    # A part gathered, packed and copied by the engine; LoRA: the adapters alone.
    synced = 0 if recipe.model.lora else 3 * sync_part_params(shape, recipe.parallel.pp) * width
    return ColocatedMemory(
        generation=trainer.weights
        + engine_weights
        + MIN_KV_CACHE_BYTES
        + HEADROOM_BYTES
        + 2 * CONTEXT_BYTES,
        training=trainer.total + 2 * CONTEXT_BYTES,
        sync=trainer.weights + synced + engine_weights + 2 * CONTEXT_BYTES,
    )


def sync_part_params(shape: ModelShape, pp: int) -> int:
    """Parameters of a weight sync's largest part: the first, with the tensors outside the
    decoder layers (embedding, output layer, MTP layers) beside `LAYERS_PER_PART` layers;
    under pipeline parallelism the whole model, gathered as one part."""
    whole = parameters(shape)
    if pp > 1:
        return whole
    per_layer = [
        sum(moe_layer_params(shape, 1, 1)) if shape.is_moe_layer(i) else layer_params(shape, 1)
        for i in range(shape.layers)
    ]
    outside = whole - sum(per_layer)
    return outside + sum(sorted(per_layer, reverse=True)[:LAYERS_PER_PART])


@rule("resources", "rollout", "task", "parallel")
def _colocated_layout(r: Recipe) -> Iterator[Issue]:
    if r.resources.placement != "colocate" or r.task is None:
        return
    world = r.parallel.world_size
    if r.resources.gpus_per_actor != 1:
        yield Issue(
            ("resources", "gpus_per_actor"),
            "colocated, each trainer rank and its rollout engine share one GPU: set "
            "resources.gpus_per_actor: 1 (or resources.placement: split for engines on GPUs "
            "of their own)",
        )
    if r.rollout.num_engines != world:
        yield Issue(
            ("rollout", "num_engines"),
            f"colocated, one engine shares each trainer rank's GPU: set rollout.num_engines: "
            f"{world} (the trainer's tp*pp*cp*dp)",
        )
    if r.rollout.max_staleness > 0:
        yield Issue(
            ("rollout", "max_staleness"),
            "colocated engines and trainer ranks take turns on their GPUs, so rollouts cannot "
            "run ahead of training: set rollout.max_staleness: 0, or resources.placement: "
            "split for asynchronous rollouts",
        )


@rule("resources", "rollout", "task", "model")
def _weight_transfer_fits_placement(r: Recipe) -> Iterator[Issue]:
    if r.task is None:
        return
    method, colocated = weight_transfer_method(r), r.resources.placement == "colocate"
    if method == "cuda_ipc" and not colocated:
        yield Issue(
            ("rollout", "weight_transfer"),
            "cuda_ipc hands each engine its trainer rank's GPU memory, which needs both on one "
            "GPU: set resources.placement: colocate, or rollout.weight_transfer: auto",
        )
    if method == "collective" and colocated and r.resources.gpus_per_actor > 0:
        yield Issue(
            ("rollout", "weight_transfer"),
            "colocated on one GPU, a trainer rank and its engine cannot join one NCCL group "
            "(NCCL refuses two ranks on a device): use rollout.weight_transfer: auto (CUDA "
            "IPC) or object_store",
        )


@rule("model", "parallel", "trainer", "resources", "losses", "rollout", "task")
def _colocated_phases_fit(r: Recipe) -> Iterator[Issue]:
    gib = r.resources.gpu_memory_gib
    if r.resources.placement != "colocate" or r.task is None or gib is None:
        return
    if any(t is None for t in r.losses):
        return
    memory = colocated_memory(r)
    if isinstance(memory, str):
        return
    phase, need = memory.largest()
    if need <= gib * GIB:
        return
    counted = ", ".join(f"{name} {b / GIB:.1f}" for name, b in memory.phases().items())
    yield Issue(
        ("resources", "placement"),
        f"colocated, the {phase} phase needs an estimated {need / GIB:.1f} GiB of each GPU, more "
        f"than resources.gpu_memory_gib {gib:g} (GiB by phase: {counted}; `mtprun plan` shows "
        "how they are counted): use resources.placement: split, more trainer ranks "
        "(parallel.tp), trainer.optimizer_state: bfloat16, or a smaller "
        "trainer.micro_batch_tokens",
    )
