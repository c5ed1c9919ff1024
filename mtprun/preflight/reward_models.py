"""The reward models a run serves (`task.reward: {model: <HF folder>, kind: ...}`), read from
their folders before the run: what each costs (its actor's CPUs and GPUs, its weights' memory
from config.json). What is wrong with one is its unit's check (mtprun.sources.rewards.served).

Weights' memory = parameters x bytes of the config's dtype (2 for bfloat16/float16, 4 for
float32). Parameters are the decoder's (`mtprun.preflight.memory.parameters`) with the output
layer of a classifier replaced by its score head (num_labels x hidden). vLLM adds its KV cache
on top: `VLLM_CPU_KVCACHE_SPACE` GiB on CPU, the engine's share of `gpu_memory_utilization` on
a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtprun.models.shape import ModelShape
from mtprun.preflight.memory import parameters
from mtprun.sources.rewards.served import ServedReward, labels, read_config
from mtprun.spec.actors import served_rewards
from mtprun.spec.document import KeyPath
from mtprun.spec.sections import RecipeSections

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ServedModel:
    """One served reward model as its folder describes it."""

    where: KeyPath
    spec: ServedReward
    architecture: str
    parameters: int
    dtype: str
    cpus: float
    gpus: float

    @property
    def weight_bytes(self) -> int:
        return self.parameters * _DTYPE_BYTES.get(self.dtype, 4)

    def to_dict(self) -> dict[str, Any]:
        return {
            "where": ".".join(map(str, self.where)),
            "kind": self.spec.kind,
            "model": self.spec.model,
            "architecture": self.architecture,
            "parameters": self.parameters,
            "dtype": self.dtype,
            "weight_bytes": self.weight_bytes,
            "cpus": self.cpus,
            "gpus": self.gpus,
        }


def served_models(recipe: RecipeSections) -> list[ServedModel]:
    """The recipe's served reward models whose folders are readable here."""
    res = recipe.resources
    models = []
    for where, spec in served_rewards(recipe):
        config, problem = read_config(spec)
        shape = ModelShape.read(spec.model)
        if config is None or problem is not None or shape is None:
            continue
        archs = config.get("architectures") or ["?"]
        count = parameters(shape)
        if spec.kind == "classifier":  # its score head in place of an output layer
            untied_output = 0 if shape.tie_embeddings else shape.vocab * shape.hidden
            count += labels(config) * shape.hidden - untied_output
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        models.append(
            ServedModel(where, spec, archs[0], count, dtype, res.cpus_per_actor, res.gpus_per_actor)
        )
    return models
