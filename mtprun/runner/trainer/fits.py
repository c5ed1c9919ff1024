"""A trainer that cannot fit its GPU is refused before it allocates anything: without this
the run would build the model, start the step and run out of memory deep inside a forward."""

from __future__ import annotations

import torch

from mtprun.compiler import HeadPlan
from mtprun.preflight.memory import GIB, over_budget_message, recipe_trainer_memory
from mtprun.spec import Recipe


class TrainerDoesNotFit(ValueError):
    """The trainer's estimated memory per rank exceeds the GPU's."""


def refuse_what_cannot_fit(recipe: Recipe, plan: HeadPlan, device: torch.device) -> None:
    """TrainerDoesNotFit when even the estimate (`mtprun.preflight.memory`, a floor: it leaves
    out the CUDA context, workspaces and fragmentation) exceeds `device`'s memory. Nothing to
    check on CPU, or for a model whose shape is not known here."""
    if device.type != "cuda":
        return
    memory = recipe_trainer_memory(recipe, plan)
    gpu = torch.cuda.get_device_properties(device)
    if isinstance(memory, str) or memory.total <= gpu.total_memory:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    budget = f"the {gpu.total_memory / GIB:.1f} GiB of cuda:{index} ({gpu.name})"
    raise TrainerDoesNotFit(over_budget_message(memory, budget, recipe.trainer.micro_batch_tokens))
