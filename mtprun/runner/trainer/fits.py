"""A trainer that cannot fit its GPU is refused before it allocates anything: without this
the run would build the model, start the step and run out of memory deep inside a forward.
One that fits the estimate (a floor) and still runs out says where the GPU's memory went and
what to change (`TrainerOutOfMemory`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mtprun.compiler import HeadPlan
from mtprun.preflight.memory import GIB, recipe_trainer_memory
from mtprun.preflight.memory_advice import over_budget_message
from mtprun.spec import Recipe


class TrainerDoesNotFit(ValueError):
    """The trainer's estimated memory per rank exceeds the GPU's."""


class TrainerOutOfMemory(RuntimeError):
    """A trainer rank ran out of GPU memory inside a step; the message says what to change."""


@contextmanager
def named_out_of_memory(recipe: Recipe, rank: int, doing: str) -> Iterator[None]:
    """Turns torch's OutOfMemoryError (on this process's current CUDA device, while `doing`)
    into a TrainerOutOfMemory naming the GPU's use and the settings that lower the trainer's."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        free, total = torch.cuda.mem_get_info()
        held = torch.cuda.memory_reserved()
        message = out_of_memory_message(
            str(err), recipe, rank, doing, free=free, total=total, held=held
        )
        raise TrainerOutOfMemory(message) from err


def out_of_memory_message(
    error: str, recipe: Recipe, rank: int, doing: str, free: int, total: int, held: int
) -> str:
    """The words of `named_out_of_memory`: `held` bytes reserved by this rank's process, `free` of
    the device's `total` after the failed allocation (the rest is other processes')."""
    others = max(total - free - held, 0)
    asked = error.strip().splitlines()[0].rstrip(".") if error.strip() else "out of memory"
    trainer = recipe.trainer
    remedies = [f"a smaller trainer.micro_batch_tokens (now {trainer.micro_batch_tokens})"]
    if trainer.recompute != "full":
        remedies.append("trainer.recompute: full")
    remedies.append("more parallel.tp, parallel.pp or parallel.cp")
    if others >= GIB:
        remedies.append(f"a GPU without the other processes' {others / GIB:.1f} GiB")
    return (
        f"trainer rank {rank} ran out of GPU memory {doing} ({asked}): its process holds "
        f"{held / GIB:.1f} GiB, other processes {others / GIB:.1f} GiB, {free / GIB:.1f} GiB "
        f"free of {total / GIB:.1f} GiB; try " + ", ".join(remedies[:-1]) + " or " + remedies[-1]
    )


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
