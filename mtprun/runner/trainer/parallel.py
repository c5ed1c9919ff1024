"""Process groups for the trainer: torch.distributed + Megatron-core model parallelism."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from mtprun.runner.net import free_port
from mtprun.runner.trainer.cpu_shims import apply_cpu_shims, needs_cpu_shims, reset_rng_tracker


def init_parallel(
    parallel: Any,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    seed: int = 0,
) -> None:
    """Join the trainer's process group and set up Megatron's TP/PP/CP/DP groups.

    parallel: the recipe's `parallel` section (tp, pp, cp, dp, ep); tp*pp*cp*dp must equal
    world_size, and ep (expert parallelism) divides dp: each group of ep data-parallel ranks
    splits the experts. backend: None picks gloo on CPU and nccl on GPU.
    """
    sizes = {k: int(getattr(parallel, k)) for k in ("tp", "pp", "cp", "dp")}
    product = sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"]
    if product != world_size:
        raise ValueError(
            f"parallel: tp*pp*cp*dp = {product} ({sizes}) but the trainer has {world_size} "
            "processes; make the product equal the number of trainer processes"
        )
    ep = int(getattr(parallel, "ep", 1))
    if sizes["dp"] % ep:
        raise ValueError(f"parallel.ep={ep} does not divide parallel.dp={sizes['dp']}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    apply_cpu_shims()
    if backend is None:
        backend = "gloo" if needs_cpu_shims() else "nccl"
    if not needs_cpu_shims():
        if sizes["tp"] > 1:
            _one_work_queue()
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=sizes["pp"],
        context_parallel_size=sizes["cp"],
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,  # whole experts on each rank (see trainer/experts.py)
        # The distributed optimizer gathers its state for checkpoints over gloo groups.
        create_gloo_process_groups=True,
    )
    if needs_cpu_shims():
        reset_rng_tracker()
    else:
        model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def _one_work_queue() -> None:
    """Under tensor parallelism, one hardware work queue a GPU (CUDA_DEVICE_MAX_CONNECTIONS=1,
    read when the process creates its CUDA context; a value already set is kept).

    Megatron-core's column-parallel backward launches the input gradient's all-reduce on
    NCCL's stream, then the weight-gradient GEMM on the compute stream, meaning them to overlap.
    With CUDA's default of 8 queues the GPU may start the GEMM first, and the all-reduce then
    waits for free SMs until it ends; with one queue kernels start in launch order. Qwen3-8B at
    tp = 2 on two H200s: 0.84 s a step against 0.97-1.04 s (bench/RESULTS.md, run 91).
    """
    if torch.cuda.is_initialized():
        return  # too late for this process: its context has its queues
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def ensure_parallel(parallel: Any, seed: int) -> None:
    """Initialise a single-process layout, or check that the initialised one is the recipe's
    `parallel` section (a Trainer built without `init_parallel`: tests, one-process runs)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        sizes = {
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
        }
        asked = {name: getattr(parallel, name) for name in sizes}
        if asked != sizes:
            raise ValueError(
                f"parallel: the recipe asks for {asked} but this process group was initialised "
                f"with {sizes}; pass the recipe's parallel section to init_parallel"
            )
        return
    if parallel.world_size != 1:
        raise RuntimeError(
            f"parallel: {parallel.world_size} trainer processes; call "
            "mtprun.runner.trainer.parallel.init_parallel(...) in each of them before Trainer(...)"
        )
    init_parallel(parallel, 0, 1, "127.0.0.1", free_port(), seed=seed)


def data_parallel_replica(rank: int, parallel: Any) -> int:
    """The data-parallel replica of trainer `rank`: Megatron-core orders ranks TP fastest,
    then CP, then DP, then PP."""
    return (rank // (parallel.tp * parallel.cp)) % parallel.dp


def ranks_gathering_for(root: int = 0) -> frozenset[int]:
    """The trainer ranks that take part in `root`'s whole-model gather (`Trainer.hf_state_dict`,
    over tensor-parallel, pipeline and expert-parallel groups): the members of `root`'s
    groups, and of theirs in turn. A data-parallel replica outside them holds a copy of the
    weights `root` gathers and need not gather at all. A collective (one all_gather_object
    of each rank's group members): every rank calls it."""
    from megatron.core import parallel_state

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return frozenset({0})
    groups = [
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_pipeline_model_parallel_group(),
    ]
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        groups.append(parallel_state.get_expert_model_parallel_group())
    mine = [dist.get_process_group_ranks(group) for group in groups]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    needed, frontier = {root}, [root]
    while frontier:
        for member in (r for group in everyone[frontier.pop()] for r in group):
            if member not in needed:
                needed.add(member)
                frontier.append(member)
    return frozenset(needed)


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
