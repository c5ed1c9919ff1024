"""Shims that let Megatron-core run on a CPU-only machine (gloo backend, CPU tensors).

Megatron-core assumes CUDA in five places that the trainer reaches on CPU:
- `torch.cuda.current_device()` is used as a device argument when tensors are created;
  returning "cpu" makes those tensors CPU tensors.
- the pipeline schedule's shape exchange calls `torch.cuda.synchronize()` after its
  point-to-point ops; gloo's ops are done once waited on, so there is nothing to wait for.
- the pipeline schedules create their token counter with `device="cuda"`; their module gets
  a view of torch whose `zeros` puts such tensors on the CPU.
- the model-parallel RNG tracker forks CUDA RNG states; the inference tracker is a plain
  context manager that needs no CUDA state.
- activation recomputation (`trainer.recompute: selective`) saves and restores the CUDA RNG
  state around each recomputed module; a CPU has none (the CPU state is still kept).
All are applied only when no GPU is present, so GPU runs use Megatron unchanged.
"""

from __future__ import annotations

import torch

_applied = False


def needs_cpu_shims() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Patch the CUDA assumptions above; idempotent, no-op on machines with a GPU."""
    global _applied
    if _applied or not needs_cpu_shims():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    _applied = True


class _TorchOnCpu:
    """torch, except that `zeros(..., device="cuda")` makes a CPU tensor."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def reset_rng_tracker() -> None:
    """Use Megatron's CUDA-free RNG tracker on CPU (call after initialize_model_parallel)."""
    if not needs_cpu_shims():
        return
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
