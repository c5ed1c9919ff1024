"""LoRA on the trainer's policy: every base weight frozen, low-rank adapters on megatron-core's
decoder linear layers (`model.lora`).

Each targeted linear layer (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) gets a
`lora` child holding one `LoRAAdapter` per HF module it fuses (names and layout:
`mtprun.models.lora`) and a forward hook that adds peft's LoRA term,
`scaling B A dropout(x)`, to the layer's output, so the base layer and its tensor-parallel
communication run unchanged.

Under tensor parallelism (sequence parallelism off: the column-parallel layers' input is whole
on every rank):
- column-parallel (`linear_qkv`, `linear_fc1`): A is replicated, so u = A x is whole on every
  rank; B holds this rank's output rows (q/k/v by whole heads, gate/up by rows, like the base),
  and the rank's B u is placed into the base's per-group [q, k, v] / [gate; up] layout. u
  passes through megatron's copy-to-tensor-parallel region (backward: the sum over ranks of
  its gradient, each rank's B contributing its rows), so A's gradient is whole and equal on
  every rank.
- row-parallel (`linear_proj`, `linear_fc2`): the input is this rank's slice, so A holds the
  matching input columns; the partial products A_r x_r are summed over ranks (one extra
  all-reduce of [T, r]), and the replicated B maps the sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from mtprun.models.lora import LAYERS, adapter_name, init_adapters, load_peft_adapters
from mtprun.models.shape import ModelShape
from mtprun.models.tp_layout import shard
from mtprun.spec.model import LORA_TARGETS, LoRASection

_COLUMN = ("qkv", "fc1")


class LoRAAdapter(torch.nn.Module):
    """One HF module's adapter: `lora_A` [r, in], `lora_B` [out, r] (this rank's shards), and
    dropout on its input."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, dropout: float) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.dropout(x), self.lora_A.to(x.dtype))


class LoRALayer(torch.nn.ModuleDict):
    """The adapters of one Megatron linear layer, by HF module name, and the hook that adds
    their output."""

    def __init__(
        self,
        target: str,
        adapters: dict[str, LoRAAdapter],
        scaling: float,
        groups: int,
        tp_group: Any = None,
    ) -> None:
        super().__init__(adapters)
        self.target = target
        self.tp_group = tp_group  # the base layer's
        self.scaling = scaling
        self.groups = groups  # query groups on this rank (linear_qkv's layout)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' term of the layer's output, in the base output's layout."""
        column = self.target in _COLUMN
        parts = []
        for adapter in self.values():
            u = adapter.down(x)
            u = (
                copy_to_tensor_model_parallel_region(u, self.tp_group)
                if column
                else reduce_from_tensor_model_parallel_region(u, self.tp_group)
            )
            parts.append(F.linear(u, adapter.lora_B.to(u.dtype)) * self.scaling)
        if self.target == "qkv":  # per query group: [q heads of the group, k, v]
            q, k, v = (p.reshape(*p.shape[:-1], self.groups, -1) for p in parts)
            return torch.cat([q, k, v], dim=-1).flatten(-2)
        if self.target == "fc1":  # [gate; up] of this rank
            return torch.cat(parts, dim=-1)
        return parts[0]

    def hook(self, module, args, kwargs, output):
        x = args[0] if args else kwargs.get("input_", kwargs.get("input"))
        out, bias = output
        return out + self.delta(x).to(out.dtype), bias


def attach_lora(
    model: torch.nn.Module, lora: LoRASection, tp_rank: int, tp_size: int, seed: int
) -> list[str]:
    """Freeze every parameter of `model` (a `PolicyModel` stage) and give its decoder layers'
    targeted linear layers adapters, this rank's shards of the whole model's: those of the PEFT
    folder `lora.path`, else `init_adapters`' (whole-model layer indices, so a layout never
    changes the adapters), in the model's parameter dtype. Returns the adapters' parameter
    names."""
    shape: ModelShape = model.shape
    if shape.experts is not None and {"fc1", "fc2"} & set(lora.layers):
        raise ValueError(
            "model.lora: LoRA on a mixture-of-experts model's MLP (its experts) is not "
            "supported yet: use targets: [qkv, proj]"
        )
    model.requires_grad_(False)
    offset = model.stage.layer_offset
    layers = model.decoder.layers
    full = (
        load_peft_adapters(lora.path, lora, shape)
        if lora.path is not None
        else init_adapters(shape, lora.layers, lora.rank, range(offset, offset + len(layers)), seed)
    )
    dtype = next(model.parameters()).dtype
    groups = shape.kv_heads // tp_size
    for j, layer in enumerate(layers):
        for target in lora.layers:
            linear = layer.get_submodule(LAYERS[target])
            adapters = {}
            for module in LORA_TARGETS[target]:
                a, b = (
                    shard(name, full[name], tp_rank, tp_size).to(
                        device=linear.weight.device, dtype=dtype
                    )
                    for name in (adapter_name(offset + j, target, module, m) for m in "AB")
                )
                adapters[module] = LoRAAdapter(a, b, lora.dropout)
            tp_group = getattr(linear, "tp_group", None)
            linear.lora = LoRALayer(target, adapters, lora.scaling, groups, tp_group)
            linear.register_forward_hook(linear.lora.hook, with_kwargs=True)
    if getattr(model, "pre_process", False):
        # Frozen embeddings give the first layer an input without gradient: a checkpointed
        # (recomputed) block would then drop its adapters' gradients. As peft's
        # enable_input_require_grads does, the embedding's output asks for one.
        model.embedding.register_forward_hook(_require_grad)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _require_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output
