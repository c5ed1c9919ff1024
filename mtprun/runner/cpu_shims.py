"""Shims that let Megatron-core run on a CPU-only machine (gloo backend, CPU tensors).

Megatron-core assumes CUDA in two places that the trainer reaches on CPU:
- `torch.cuda.current_device()` is used as a device argument when tensors are created;
  returning "cpu" makes those tensors CPU tensors.
- the model-parallel RNG tracker forks CUDA RNG states; the inference tracker is a plain
  context manager that needs no CUDA state.
Both are applied only when no GPU is present, so GPU runs use Megatron unchanged.
"""

from __future__ import annotations

import torch

_applied = False


def needs_cpu_shims() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Patch torch.cuda.current_device; idempotent, no-op on machines with a GPU."""
    global _applied
    if _applied or not needs_cpu_shims():
        return
    torch.cuda.current_device = lambda: "cpu"
    _applied = True


def reset_rng_tracker() -> None:
    """Use Megatron's CUDA-free RNG tracker on CPU (call after initialize_model_parallel)."""
    if not needs_cpu_shims():
        return
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
