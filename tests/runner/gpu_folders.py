"""Tiny model folders for the CUDA tests: bf16, head_dim 128 (what the GPU attention kernels
take), written on the GPU."""

from __future__ import annotations

from pathlib import Path

import torch

from mtprun.models.tiny import build_tiny_model
from mtprun.spec.model import TinyModel


def gpu_folder(root: Path, tokenizer, architecture: str, seed: int = 0, **fields) -> Path:
    """A random-init bf16 folder of `architecture` (seeded) with `fields` over the defaults."""
    spec = TinyModel(
        architecture=architecture, hidden=256, layers=2, heads=2, kv_heads=1, intermediate=512,
        max_seq_len=512, **fields,
    )  # fmt: skip
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return build_tiny_model(spec, tokenizer, root, seed=seed)
    finally:
        torch.set_default_dtype(saved)
