"""Models: tiny random-init HF checkpoints and HF <-> Megatron-core weight conversion."""

from mtprun.models.convert import hf_to_megatron, megatron_to_hf
from mtprun.models.dims import ModelDims
from mtprun.models.tiny import build_tiny_model

__all__ = ["ModelDims", "build_tiny_model", "hf_to_megatron", "megatron_to_hf"]
