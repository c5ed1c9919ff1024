"""`to_device`: a host tensor's copy onto a GPU that does not wait for the GPU.

A copy from pageable host memory synchronizes the stream (CUDA stages it through a pinned
buffer only once the queued work is done), so the trainer's per-micro-batch copies of batch
fields and attention layouts each drained the GPU before the micro batch began (run 90's
profile of a Qwen3-8B tp = 2 step: 20-32 such stalls, bench/RESULTS.md). Copied into pinned
memory first (torch's caching host allocator, which keeps the block until the copy is done),
the copy is queued behind the GPU's work and the host runs on.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; from the host onto a GPU through pinned memory, not blocking."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
