"""`resources:` the Ray cluster and what each actor asks of it."""

from typing import Any, Literal

from pydantic import Field

from mtprun.spec.base import Section


class ResourcesSection(Section):
    """The Ray cluster and what each actor asks of it."""

    ray_address: str | None = Field(
        None, description="Address of a running Ray cluster; null starts a local one."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local Ray instance; null lets Ray decide."
    )
    num_gpus: int = Field(0, ge=0, description="GPUs of the local Ray instance.")
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description=(
            "Memory of each trainer GPU in GiB (e.g. 80 for an H100); when set, `mtprun "
            "validate` warns if the trainer's estimated peak per rank does not fit in it."
        ),
    )
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs each trainer/rollout actor takes.")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs each trainer/rollout actor takes.")
    placement: Literal["split", "colocate"] = Field(
        "split",
        description="Where the rollout engines run on GPUs. `split`: on GPUs of their own "
        "(gpus_per_actor each, beside the trainer's). `colocate`: engine i shares the GPU of "
        "trainer rank i (one engine per rank); while the engines generate, the trainer's "
        "optimizer state and gradients wait on the host, while the trainer trains the engines "
        "sleep (KV cache and weights released), and weights reach them through CUDA IPC. "
        "Needs the synchronous loop (rollout.max_staleness 0).",
    )
    wait_for_resources_s: float = Field(
        600,
        ge=0,
        description=(
            "On a Ray cluster (ray_address), how long the run waits for the cluster to hold "
            "the CPUs and GPUs its actors need (an autoscaler adding nodes) before it fails "
            "with what is missing; a local instance that is too small fails at once."
        ),
    )
    world_size: int | None = Field(
        None,
        ge=1,
        description="Trainer processes; when set it must equal tp*pp*cp*dp.",
    )


def weight_transfer_method(recipe: Any) -> str:
    """`rollout.weight_transfer` with `auto` resolved: CUDA IPC between colocated trainer
    ranks and engines (LoRA's adapters, a few MiB, through the object store), a collective
    broadcast to engines of their own."""
    chosen = recipe.rollout.weight_transfer
    if chosen != "auto":
        return chosen
    if recipe.resources.placement == "colocate":
        return "object_store" if recipe.model.lora is not None else "cuda_ipc"
    return "collective"
