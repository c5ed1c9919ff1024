"""Shims that let Megatron-core run on a CPU-only machine (gloo backend, CPU tensors).

Megatron-core assumes CUDA in seven places that the trainer reaches on CPU:
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
- the MoE all-to-all token dispatcher copies its split sizes to the host on a side CUDA
  stream; on a CPU there is one stream, so `torch.cuda.Stream()` and `current_stream()` are
  one object whose waits are no-ops, and `torch.cuda.stream(...)` enters nothing.
- that copy also turns the split sizes into numpy arrays, which the all-to-all takes as
  lists of ints; a tensor already on the CPU is left a tensor, which it refuses: the shim
  converts those too.
All are applied only when no GPU is present, so GPU runs use Megatron unchanged.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def needs_cpu_shims() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Patch the CUDA assumptions above; idempotent, no-op on machines with a GPU."""
    global _applied
    if not needs_cpu_shims():
        return
    _one_stream()  # every time: vLLM's CPU worker installs its own at import
    if _applied:
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    _applied = True


def _one_stream() -> None:
    """The CPU's one stream as torch.cuda's streams and as the MoE dispatcher's side stream.
    Re-applied on every call: importing vLLM's CPU worker (an engine in the same process, as
    in tests) replaces torch.cuda.Stream with a placeholder whose events are None, and a
    dispatcher built after that keeps it as its class-wide side stream."""
    from megatron.core.transformer.moe import token_dispatcher

    torch.cuda.Stream = _OneStream  # a class still: vLLM annotates with `Stream | None`
    torch.cuda.current_stream = lambda device=None: _OneStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _OneStream()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's `maybe_move_tensor_to_cpu` for tensors that are on the CPU already."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


class _OneStream:
    """The CPU's one stream (one instance): everything on it is already ordered."""

    _instance: _OneStream | None = None

    def __new__(cls, *args: object, **kwargs: object) -> _OneStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self) -> _OneStream:
        return self  # an event whose synchronize() has nothing to wait for


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
