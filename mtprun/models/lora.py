"""LoRA adapters in Megatron's layout: their names, their full (tp=1) initial values, their
PEFT names and their merge into the base weights.

One adapter per HF module, as peft makes them (q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj), each an `A` [r, in] and a `B` [out, r] in HF's orientation, held under the
Megatron linear layer that fuses the module:

    decoder.layers.{i}.self_attention.linear_qkv.lora.{q_proj,k_proj,v_proj}.lora_{A,B}
    decoder.layers.{i}.self_attention.linear_proj.lora.o_proj.lora_{A,B}
    decoder.layers.{i}.mlp.linear_fc1.lora.{gate_proj,up_proj}.lora_{A,B}
    decoder.layers.{i}.mlp.linear_fc2.lora.down_proj.lora_{A,B}

so `W x + scaling B A x` is peft's LoRA of that module, and a PEFT adapter maps one to one
(`peft_name`). Tensor-parallel splits (`mtprun.models.tp_layout.split_of`): a column-parallel
layer's B splits along its output like the base (q/k/v each by whole heads, so per query group;
gate and up each by rows), its A is replicated; a row-parallel layer's A splits along its input
and its B is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from mtprun.models.decoder import fuse_qkv
from mtprun.models.peft_adapter import (
    ADAPTER_WEIGHTS,
    adapter_problem,
    module_features,
    peft_tensor_name,
)
from mtprun.models.shape import ModelShape
from mtprun.spec.model import LORA_TARGETS, LoRASection

LORA = ".lora."  # the infix of every adapter tensor's name

# Megatron linear layer of each target, under its decoder layer.
LAYERS = {
    "qkv": "self_attention.linear_qkv",
    "proj": "self_attention.linear_proj",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
}


def is_adapter(name: str) -> bool:
    return LORA in name


def features(shape: ModelShape, module: str) -> tuple[int, int]:
    """(in, out) features of HF module `module` of the full (tp=1) model."""
    return module_features(shape)[module]


def adapter_name(layer: int, target: str, module: str, matrix: str) -> str:
    """The Megatron name of adapter `matrix` (A or B) of HF module `module` in decoder layer
    `layer` (an index of the whole model, or of a pipeline stage's)."""
    return f"decoder.layers.{layer}.{LAYERS[target]}.lora.{module}.lora_{matrix}"


def init_adapters(
    shape: ModelShape, targets: tuple[str, ...], rank: int, layers: range, seed: int
) -> dict[str, torch.Tensor]:
    """Full (tp=1) float32 initial adapters of decoder `layers` (whole-model indices), as peft
    initialises them: A kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B zero.
    Each A is drawn from (seed, layer, module) alone, so every rank, stage and layout draws the
    same adapters."""
    out = {}
    for i in layers:
        for target in targets:
            for j, module in enumerate(LORA_TARGETS[target]):
                n_in, n_out = features(shape, module)
                g = torch.Generator().manual_seed(
                    (seed * 1_000_003 + i * 64 + list(LAYERS).index(target) * 8 + j) % 2**63
                )
                bound = 1.0 / math.sqrt(n_in)
                a = (torch.rand(rank, n_in, generator=g) * 2 - 1) * bound
                out[adapter_name(i, target, module, "A")] = a
                out[adapter_name(i, target, module, "B")] = torch.zeros(n_out, rank)
    return out


def merge_lora(
    full: Mapping[str, torch.Tensor], shape: ModelShape, scaling: float
) -> dict[str, torch.Tensor]:
    """Full (gathered, whole-model) Megatron tensors with adapters -> the same without them,
    each adapted weight W replaced by W + scaling B A (in W's dtype; computed in float32)."""
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in full.items():
        if not is_adapter(name) or not name.endswith("lora_A"):
            continue
        layer, rest = name.split(LORA)
        module = rest.split(".")[0]
        b = full[name[: -len("lora_A")] + "lora_B"]
        deltas.setdefault(layer, {})[module] = scaling * (b.float() @ tensor.float())
    out = {n: t for n, t in full.items() if not is_adapter(n)}
    for layer, parts in deltas.items():
        if layer.endswith("linear_qkv"):
            delta = fuse_qkv(parts["q_proj"], parts["k_proj"], parts["v_proj"], shape)
        elif layer.endswith("linear_fc1"):
            delta = torch.cat([parts["gate_proj"], parts["up_proj"]])
        else:
            (delta,) = parts.values()
        weight = out[layer + ".weight"]
        out[layer + ".weight"] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return out


def peft_name(name: str) -> str:
    """Megatron adapter name (whole-model layer index) -> the name in a PEFT adapter file
    (`adapter_model.safetensors`; a live peft model adds the adapter's name, `.default`,
    before `.weight`)."""
    head, rest = name.split(LORA)
    module, matrix = rest.split(".")
    return peft_tensor_name(int(head.split(".")[2]), module, matrix.removeprefix("lora_"))


def load_peft_adapters(
    folder: str | Path, lora: LoRASection, shape: ModelShape
) -> dict[str, torch.Tensor]:
    """The adapters of PEFT adapter folder `folder` (`model.lora.path`) under their Megatron
    names (whole-model layer indices), float32, as `init_adapters` gives fresh ones; a
    ValueError at model.lora.path when the folder does not fit `lora` and the model."""
    problem = adapter_problem(folder, lora, shape)
    if problem is not None:
        raise ValueError(f"model.lora.path: {problem}")
    tensors = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    names = (
        adapter_name(i, target, module, matrix)
        for i in range(shape.layers)
        for target in lora.layers
        for module in LORA_TARGETS[target]
        for matrix in "AB"
    )
    return {name: tensors[peft_name(name)].float() for name in names}
