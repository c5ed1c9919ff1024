"""One vLLM rollout engine as a Ray actor (`ray.remote(...)` is applied where the pool
starts it), so this module imports no engine at import time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


class RolloutWorker:
    """One vLLM engine. Ray restarts it (same arguments) when its process dies; the driver
    then syncs the current weights into it before retrying its prompts."""

    def __init__(
        self, model_dir: str, rollout: Any, seed: int, work_dir: str, torch_threads: int | None
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        from mtprun.runner.rollout.engine import RolloutEngine

        self.engine = RolloutEngine(Path(model_dir), rollout, seed, Path(work_dir))

    def pid(self) -> int:
        return os.getpid()

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> list[list[Any]]:
        return self.engine.generate(prompts, n, max_tokens, stop_token_ids, temperature, top_p)

    def update_weights(self, weights: dict[str, torch.Tensor]) -> float:
        return self.engine.update_weights(weights.items())

    def spec_decode_counters(self) -> dict[str, float]:
        return self.engine.spec_decode_counters()

    def shutdown(self) -> None:
        self.engine.shutdown()
