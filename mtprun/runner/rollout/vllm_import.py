"""vLLM's import in an engine process, with Python's cyclic garbage collector kept off it.

Importing vLLM creates ~850k objects (torch, transformers, vLLM's own modules); each full
collection walks all of them. The collector's own thresholds run ~10 full collections
during the import, and vLLM's start runs ~5 more itself (`gc.collect()` around model load
and KV-cache profiling): together ~4 of an engine start's ~17 CPU-seconds on a 2-core
machine. Pausing automatic collection for the import and freezing what it built
(`gc.freeze`: later collections skip those objects, which live as long as the process
anyway) leaves those collections only the engine's own objects: ~2.2 CPU-seconds less per
engine start. vLLM (0.32) freezes the heap itself once the engine is up and unfreezes it at
shutdown, which then collects whatever the import left as garbage."""

from __future__ import annotations

import gc
from pathlib import Path

from mtprun.runner.rollout.engine import configure_vllm_env


def import_vllm(work_dir: Path) -> None:
    """`configure_vllm_env(work_dir)`, then import vLLM's `LLM` (what `RolloutEngine`
    imports) with automatic collection paused, and freeze the heap it leaves."""
    configure_vllm_env(work_dir)
    enabled = gc.isenabled()
    gc.disable()
    try:
        import vllm.entrypoints.llm  # noqa: F401
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
