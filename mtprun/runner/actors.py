"""Ray actors around the engines: trainer ranks (Megatron-core) and rollout engines (vLLM).

The classes are plain Python; `ray.remote(...)` with the recipe's resources is applied where
they are started (driver), so this module imports no engine at import time.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch

from mtprun.compiler import HeadPlan
from mtprun.data.batch import PackedBatch
from mtprun.runner.export import save_hf_folder

log = logging.getLogger("mtprun")


def stop_actors(actors: list[Any], timeout_s: float = 60) -> None:
    """Ask each actor to release its engine, then kill its process (also a dead or hung one)."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.shutdown.remote(), timeout=timeout_s)
        except Exception as err:  # dead or hung: the kill below still ends it
            log.debug("actor shutdown: %s", err)
        ray.kill(actor, no_restart=True)


def torch_threads(resources: Any, actors_at_once: int) -> int | None:
    """CPU threads per actor. On CPU the trainer and the engines take turns, so each may use
    the cluster's cores; with GPUs torch's default stands."""
    import ray

    if resources.gpus_per_actor > 0:
        return None
    cpus = min(os.cpu_count() or 1, int(ray.cluster_resources().get("CPU", 1)))
    return max(1, cpus // max(1, actors_at_once))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class TrainerWorker:
    """One trainer rank, kept for the whole attempt; each stage builds a fresh Trainer in it
    (Megatron and the process group are set up once). Every collective method must be called
    on all ranks together."""

    def __init__(self, rank: int, world_size: int, torch_threads: int | None) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.rank = rank
        self.world_size = world_size
        self.model_dir: Path | None = None
        self.trainer: Any = None
        self.reference: Any = None

    def pid(self) -> int:
        """This rank's process id; answering at all says the process lives."""
        return os.getpid()

    def rendezvous_address(self) -> tuple[str, int]:
        """Address for torch.distributed, asked of rank 0 only."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, parallel: Any, seed: int, master_addr: str, master_port: int) -> int:
        """Join the process group; returns the process id (for logs)."""
        from mtprun.runner.parallel import init_parallel

        init_parallel(parallel, self.rank, self.world_size, master_addr, master_port, seed=seed)
        return os.getpid()

    def build(self, recipe: Any, model_dir: str, plan_json: str, with_reference: bool) -> None:
        """A Trainer for a stage: `recipe` as the stage sees it, starting from `model_dir`."""
        from mtprun.runner.trainer import Trainer

        device = "cpu" if not torch.cuda.is_available() else f"cuda:{torch.cuda.current_device()}"
        plan = HeadPlan.from_json(plan_json)
        self.model_dir = Path(model_dir)
        self.trainer = self.reference = None  # free the previous stage's model first
        self.trainer = Trainer(recipe, self.model_dir, plan, device)
        if with_reference:
            # The KL reference is the policy this stage starts from, frozen.
            self.reference = Trainer(recipe, self.model_dir, plan, device)

    def train_step(self, micro_batches: list[PackedBatch]) -> dict[str, float]:
        return self.trainer.train_step(micro_batches)

    def logprobs(self, batches: list[PackedBatch], reference: bool = False) -> list[torch.Tensor]:
        model = self.reference if reference else self.trainer
        return model.logprobs(batches)

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights (gathered over TP and pipeline stages); only rank 0 returns
        them."""
        weights = self.trainer.hf_state_dict()
        return weights if self.rank == 0 else None

    def save(self, folder: str) -> None:
        """Write this rank's trainer state and (rank 0) the policy as an HF folder."""
        target = Path(folder)
        torch.save(self.trainer.state_dict(), target / f"trainer_rank{self.rank}.pt")
        weights = self.trainer.hf_state_dict()
        if self.rank == 0:
            save_hf_folder(weights, self.model_dir, target / "hf")

    def load(self, folder: str) -> int:
        state = torch.load(
            Path(folder) / f"trainer_rank{self.rank}.pt", map_location="cpu", weights_only=False
        )
        self.trainer.load_state_dict(state)
        return int(self.trainer.step)

    def shutdown(self) -> None:
        from mtprun.runner.parallel import destroy_parallel

        destroy_parallel()


class RolloutWorker:
    """One vLLM engine. Ray restarts it (same arguments) when its process dies; the driver
    then syncs the current weights into it before retrying its prompts."""

    def __init__(
        self, model_dir: str, rollout: Any, seed: int, work_dir: str, torch_threads: int | None
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        from mtprun.runner.rollout import RolloutEngine

        self.engine = RolloutEngine(Path(model_dir), rollout, seed, Path(work_dir))

    def pid(self) -> int:
        return os.getpid()

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[list[Any]]:
        return self.engine.generate(
            prompts, n, max_tokens=max_tokens, stop_token_ids=stop_token_ids
        )

    def update_weights(self, weights: dict[str, torch.Tensor]) -> float:
        return self.engine.update_weights(weights.items())

    def spec_decode_counters(self) -> dict[str, float]:
        return self.engine.spec_decode_counters()

    def shutdown(self) -> None:
        self.engine.shutdown()
