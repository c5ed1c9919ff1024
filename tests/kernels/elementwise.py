"""What the tests of the trainer's elementwise Triton kernels (RoPE, SwiGLU) share: where they
run and how close to float64 they must come."""

from __future__ import annotations

import os

import pytest
import torch

# bf16 outputs round once from float32 arithmetic: half an ulp is 2**-9 relative.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 2e-2)}


def triton_device() -> str:
    """ "cuda" where a GPU is, "cpu" under the Triton interpreter (TRITON_INTERPRET=1, how
    `test_triton_head_loss.py` runs these modules on CI); anywhere else the calling module is
    skipped."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
