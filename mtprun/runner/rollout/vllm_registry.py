"""vLLM's model-class inspection in the engine's own process on CPU machines.

Before it builds a model, vLLM learns what the class supports (`_ModelInfo`: text generation,
pooling, multimodal, ...). For a class it has not imported yet it does so in a fresh Python
subprocess that imports vLLM and the class (so that a GPU server does not initialize CUDA
before it forks its workers), and caches the answer in `VLLM_CACHE_ROOT` keyed by the class's
source: a machine whose cache has not seen a class pays ~9-25 CPU-seconds for it on two cores
(measured: Qwen3.5's model 24 s and its MTP drafter 25 s), the first run on every CI machine
for every class it serves. An mtprun engine runs vLLM in its own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and imports the class there anyway; on a CPU machine there
is no CUDA to keep out of it, so the inspection runs in that process, at the cost of the
class's import, and still fills the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


def inspect_models_in_process() -> None:
    """Route vLLM's model-class inspection into this process (see the module docstring);
    a vLLM without that subprocess step is left as it is. For CPU engines only."""
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = _run_here


def _run_here(fn: Callable[[], _T]) -> _T:
    return fn()
