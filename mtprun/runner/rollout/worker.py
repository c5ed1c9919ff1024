"""One vLLM rollout engine as a Ray actor (`ray.remote(...)` is applied where the pool
starts it), so this module imports no engine at import time."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from mtprun.runner.rollout.engine import Sampling


class RolloutWorker:
    """One vLLM engine. Ray restarts it (same arguments) when its process dies; the driver
    then syncs the current weights into it before retrying its prompts, and a collective
    weight transfer forms its group again with it."""

    def __init__(
        self,
        model_dir: str,
        rollout: Any,
        seed: int,
        work_dir: str,
        torch_threads: int | None,
        version: int,
        routed_experts: bool = False,
        lora: Any = None,
        colocate: bool = False,
        dtype: str | None = None,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        from mtprun.runner.rollout.engine import RolloutEngine
        from mtprun.runner.rollout.vllm_import import import_vllm

        import_vllm(Path(work_dir))  # before the engine: its start then skips that heap

        self.engine = RolloutEngine(
            Path(model_dir),
            rollout,
            seed,
            Path(work_dir),
            version,
            routed_experts,
            lora,
            colocate,
            dtype=dtype,
        )
        self.transfer: Any = None  # this engine's membership of the weight-transfer group

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Any]]:
        return self.engine.generate(prompts, n, sampling)

    def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """The trainer's sync payload (full weights, or with LoRA the adapters) from the
        object store, as policy `version`; returns seconds in vLLM."""
        return self.engine.update_weights(weights.items(), version)

    def begin_update(self, version: int) -> None:
        """An update to policy `version` fed in parts (colocated: `load_ipc_part` each)."""
        self.engine.begin_update(version)

    def load_part(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One part as tensors (through Ray's object store)."""
        self.engine.load_part(named)

    def load_ipc_part(self, handles: Any) -> None:
        """One part from the CUDA IPC handles of the trainer rank beside this engine."""
        self.engine.load_ipc_part(handles)

    def finish_update(self) -> float:
        """Returns the update's seconds in vLLM."""
        return self.engine.finish_update()

    def abort_update(self) -> None:
        self.engine.abort_update()

    def sleep(self) -> float:
        return self.engine.sleep()

    def wake_up(self) -> float:
        return self.engine.wake_up()

    def join_transfer(self, host: str, port: int, generation: int, rank: int, world: int) -> None:
        """Member `rank` of the transfer group's `generation` (the engine runs in this process,
        in-process vLLM: its one worker receives here what a multi-process engine's workers
        would receive through collective_rpc)."""
        from mtprun.runner.weight_transfer import TransferGroup

        self.transfer = None  # the previous generation's connections go first
        self.transfer = TransferGroup.join(host, port, generation, rank, world)

    def receive_weights(self, version: int) -> tuple[float, float]:
        """The weights trainer rank 0 broadcasts, loaded as policy `version`; returns (seconds
        waiting for the send to begin, seconds receiving and loading them: vLLM loads each
        bucket's tensors as it arrives)."""
        start = time.perf_counter()
        weights = self.transfer.receive()
        waited_s = time.perf_counter() - start
        return waited_s, self.engine.update_weights(weights, version)

    def take_generated(self) -> tuple[float, int]:
        return self.engine.take_generated()

    def spec_decode_counters(self) -> dict[str, float]:
        return self.engine.spec_decode_counters()

    def shutdown(self) -> None:
        self.transfer = None
        self.engine.shutdown()
