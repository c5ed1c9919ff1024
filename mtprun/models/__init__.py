"""Models: the model families (`mtprun.models.families`, one folder each), the model shape,
tiny random-init HF checkpoints and HF <-> Megatron-core weight conversion."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mtprun.models.shape import ModelShape

if TYPE_CHECKING:
    from mtprun.models.convert import hf_to_megatron, megatron_to_hf
    from mtprun.models.tiny import build_tiny_model

__all__ = ["ModelShape", "build_tiny_model", "hf_to_megatron", "megatron_to_hf"]


def __getattr__(name: str) -> Any:
    # Lazy so that reading a model's shape (`mtprun validate`) does not import torch.
    if name in ("hf_to_megatron", "megatron_to_hf"):
        from mtprun.models import convert

        return getattr(convert, name)
    if name == "build_tiny_model":
        from mtprun.models.tiny import build_tiny_model

        return build_tiny_model
    raise AttributeError(f"module 'mtprun.models' has no attribute {name!r}")
