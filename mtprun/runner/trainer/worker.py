"""One trainer rank as a Ray actor (`ray.remote(...)` is applied where the group starts it),
so this module imports no engine at import time."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mtprun.compiler import HeadPlan
from mtprun.data.batch import PackedBatch
from mtprun.runner.net import free_port
from mtprun.runner.policy_folder import (
    ADAPTER_FOLDER,
    HF_FOLDER,
    save_hf_folder,
    save_peft_adapter,
)
from mtprun.runner.trainer.fits import named_out_of_memory


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
        self.transfer: Any = None  # rank 0: the weight-transfer store and group (TransferHost)
        self.offloaded: Any = None  # colocated: the state on the host while engines generate
        self.shared: Any = None  # colocated: the part its engine maps now (cuda_ipc)
        self.shared_parts: Any = None  # colocated: the sync's parts still to share
        # Whether rank 0's whole-model gathers need this rank (`ranks_gathering_for`).
        self.gathers_for_rank0 = True

    def pid(self) -> int:
        """This rank's process id; answering at all says the process lives."""
        return os.getpid()

    def rendezvous_address(self) -> tuple[str, int]:
        """Address for torch.distributed, asked of rank 0 only."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, parallel: Any, seed: int, master_addr: str, master_port: int) -> int:
        """Join the process group and learn whether rank 0's whole-model gathers need this
        rank; returns the process id (for logs)."""
        from mtprun.runner.trainer.parallel import init_parallel, ranks_gathering_for

        init_parallel(parallel, self.rank, self.world_size, master_addr, master_port, seed=seed)
        self.gathers_for_rank0 = self.rank in ranks_gathering_for(0)
        return os.getpid()

    def build(self, recipe: Any, model_dir: str, plan_json: str, with_reference: bool) -> None:
        """A Trainer for a stage: `recipe` as the stage sees it, starting from `model_dir`."""
        from mtprun.runner.trainer.trainer import Trainer

        device = "cpu" if not torch.cuda.is_available() else f"cuda:{torch.cuda.current_device()}"
        plan = HeadPlan.from_json(plan_json)
        self.model_dir = Path(model_dir)
        self.trainer = self.reference = None  # free the previous stage's model first
        self.offloaded = None
        self.trainer = Trainer(recipe, self.model_dir, plan, device)
        if with_reference:
            # The KL reference is the policy this stage starts from, frozen.
            self.reference = Trainer(recipe, self.model_dir, plan, device)

    def train_step(self, micro_batches: list[PackedBatch]) -> dict[str, float]:
        with named_out_of_memory(self.trainer.recipe, self.rank, "in a training step"):
            return self.trainer.train_step(micro_batches)

    def logprobs(self, batches: list[PackedBatch], reference: bool = False) -> list[torch.Tensor]:
        model = self.reference if reference else self.trainer
        with named_out_of_memory(model.recipe, self.rank, "recomputing log-probs"):
            return model.logprobs(batches)

    def sync_weights(self) -> tuple[dict[str, torch.Tensor] | None, int]:
        """The ranks of rank 0's gathers gather what a weight sync moves (`_sync_parts`), a
        few layers at a time, and rank 0 moves each part to the host as it comes: rank 0
        returns the payload on the host (its GPU held one part of it) and its bytes, the
        other ranks (None, 0). On the host, the engines load it without a GPU copy of it."""
        if not self.gathers_for_rank0:
            return None, 0
        parts = self._sync_parts(root_only=True)
        weights = {name: t.cpu() for part in parts for name, t in part.items()}
        if self.rank != 0:
            return None, 0
        return weights, sum(t.numel() * t.element_size() for t in weights.values())

    def _sync_parts(self, root_only: bool) -> Iterator[dict[str, torch.Tensor]]:
        """What a weight sync moves, a few layers at a time (`Trainer.hf_state_dict_chunks`:
        no rank holds the whole model twice), with `root_only` on rank 0 alone; with LoRA the
        adapters alone under PEFT's names, one part (the engines serve the frozen base they
        started from with them). A collective over the ranks of the gather, part by part:
        every rank takes every part."""
        if self.trainer.recipe.model.lora is not None:
            return iter([self.trainer.adapter_state_dict(root_only)])
        return self.trainer.hf_state_dict_chunks(root_only)

    def offload(self) -> tuple[float, int]:
        """Colocated: optimizer state to the host, gradients released, while the engine on
        this GPU generates; returns (seconds, GPU bytes freed)."""
        from mtprun.runner.trainer.offload import trainer_offload

        start = time.perf_counter()
        self.offloaded = trainer_offload(self.trainer, self.offloaded)
        self.offloaded.to_host()
        return time.perf_counter() - start, self.offloaded.nbytes

    def onload(self) -> float:
        """Back from `offload` before a step; returns seconds."""
        start = time.perf_counter()
        if self.offloaded is not None:
            self.offloaded.to_device()
        return time.perf_counter() - start

    def share_next_part(self) -> tuple[Any, int] | None:
        """Colocated: the next part of what a sync moves (`_sync_parts`; every rank gathers it,
        so each serves the engine beside it) packed into buckets on this GPU; returns their
        CUDA IPC handles and bytes, or None after the last part. The previous part's buckets
        are freed first: its engine has copied them. A collective over the ranks."""
        from mtprun.runner.cuda_ipc import SharedWeights

        self._free_shared()
        if self.shared_parts is None:
            self.shared_parts = self._sync_parts(root_only=False)
        part = next(self.shared_parts, None)
        if part is None:
            self.shared_parts = None
            return None
        self.shared = SharedWeights(part)
        return self.shared.handles, self.shared.nbytes

    def release_shared(self) -> None:
        """End a stream of shared parts: the last part's buckets freed, and a stream left part
        way (an engine or the driver failed) taken to its end: this rank's share of the
        remaining parts' gathers, which its peers are in."""
        self._free_shared()
        parts, self.shared_parts = self.shared_parts, None
        _take_the_rest(parts or iter(()))

    def _free_shared(self) -> None:
        if self.shared is not None:
            self.shared.release()
            self.shared = None

    def transfer_address(self) -> tuple[str, int]:
        """Rank 0: where the engines join the weight-transfer group (a TCP store, started on
        the first call and kept for the process's life)."""
        import ray

        from mtprun.runner.weight_transfer import TransferHost

        if self.transfer is None:
            self.transfer = TransferHost(ray.util.get_node_ip_address(), free_port())
        return self.transfer.address

    def form_transfer(self, generation: int, world_size: int) -> None:
        """Rank 0: member 0 of the transfer group's `generation` (the engines join at once)."""
        self.transfer.form(generation, world_size)

    def send_weights(self) -> int | None:
        """The ranks of rank 0's gathers gather what a weight sync moves (`_sync_parts`);
        rank 0 broadcasts each part to the engines as it is gathered
        and returns the bytes each engine received."""
        if not self.gathers_for_rank0:
            return None
        parts = self._sync_parts(root_only=True)
        try:
            return self.transfer.group.send_parts(parts) if self.rank == 0 else None
        finally:  # also after a failed broadcast
            _take_the_rest(parts)

    def save(self, folder: str) -> dict[str, float]:
        """Write this rank's trainer state and (rank 0) the policy as an HF folder, and with
        LoRA its adapters as a PEFT adapter folder on the stage's starting model; returns the
        seconds each part took on this rank."""
        target = Path(folder)
        start = time.perf_counter()
        save_without_checksums(self.trainer.state_dict(), target / f"trainer_rank{self.rank}.pt")
        seconds = {"trainer state": time.perf_counter() - start}
        if not self.gathers_for_rank0:  # rank 0 writes the folders from its gathers alone
            return seconds
        start = time.perf_counter()
        # A few layers at a time: neither the GPU nor the host holds the whole model.
        parts = self.trainer.hf_state_dict_chunks(root_only=True)
        try:
            if self.rank == 0:
                save_hf_folder(parts, self.model_dir, target / HF_FOLDER)
        finally:  # the other ranks', and rank 0's after a failed write
            _take_the_rest(parts)
        lora = self.trainer.recipe.model.lora
        if lora is not None:
            adapters = self.trainer.adapter_state_dict(root_only=True)
            if self.rank == 0:
                base = str(self.model_dir.resolve())
                save_peft_adapter(adapters, lora, base, target / ADAPTER_FOLDER)
        seconds["HF folder"] = time.perf_counter() - start
        return seconds

    def load(self, folder: str) -> int:
        state = torch.load(
            Path(folder) / f"trainer_rank{self.rank}.pt", map_location="cpu", weights_only=False
        )
        self.trainer.load_state_dict(state)
        return int(self.trainer.step)

    def shutdown(self) -> None:
        from mtprun.runner.trainer.parallel import destroy_parallel

        self.transfer = None
        destroy_parallel()


def _take_the_rest(parts: Iterator[dict[str, torch.Tensor]]) -> None:
    """The parts of a gather this rank has not taken: its share of their collectives, which
    its peers are in (a rank that stops part way leaves them waiting)."""
    for _ in parts:
        pass


def save_without_checksums(state: Any, path: Path) -> None:
    """torch.save without the CRC-32 of each zip entry, which costs more than the write
    itself (3 GiB to /tmp: 5.5 -> 1.5 CPU-s). A checkpoint is published by one rename once
    complete, and its HF folder (safetensors) carries no checksum either."""
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        torch.save(state, path)
