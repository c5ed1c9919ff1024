"""PEFT LoRA adapter folders, as peft's `save_pretrained` writes them and `model.lora.path`
reads them:

    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, ...
    adapter_model.safetensors    base_model.model.model.layers.{i}.{self_attn,mlp}.{module}
                                 .lora_{A,B}.weight: A [r, in], B [out, r]

What a folder must be to start `model.lora` from it (`adapter_problem`) is read from the
config and the safetensors header alone: no tensor is loaded and torch is not imported, so
`mtprun validate` checks it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from mtprun.models.shape import ModelShape
from mtprun.spec.model import LORA_TARGETS, LoRASection

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# peft features whose adapters are not W + alpha / r B A on whole modules (what mtprun trains),
# with the config value that leaves them off.
_UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layers_to_transform": None,
    "fan_in_fan_out": False,
    "bias": "none",
}


def module_features(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each HF module adapters go on, in the full (tp=1) model."""
    h, q, kv, f = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.intermediate,
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }


def peft_tensor_name(layer: int, module: str, matrix: str) -> str:
    """The name of adapter `matrix` (A or B) of HF module `module` of decoder layer `layer` in
    `adapter_model.safetensors`."""
    parent = "mlp" if module in (*LORA_TARGETS["fc1"], *LORA_TARGETS["fc2"]) else "self_attn"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{matrix}.weight"


def expected_tensors(shape: ModelShape, lora: LoRASection) -> dict[str, tuple[int, int]]:
    """PEFT name -> shape of every adapter tensor `lora` gives the model of `shape`."""
    features = module_features(shape)
    out = {}
    for layer in range(shape.layers):
        for module in lora.modules:
            n_in, n_out = features[module]
            out[peft_tensor_name(layer, module, "A")] = (lora.rank, n_in)
            out[peft_tensor_name(layer, module, "B")] = (n_out, lora.rank)
    return out


def adapter_config(lora: LoRASection, base_model: str) -> dict[str, Any]:
    """The adapter_config.json of `lora`'s adapters on `base_model` (peft's LoraConfig fields;
    peft and vLLM fill the ones left out with their defaults)."""
    alpha = lora.lora_alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.modules),
        "inference_mode": True,
        "init_lora_weights": True,
        **_UNSUPPORTED,
    }


def read_safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of a safetensors file, from its header (8 bytes of
    little-endian header length, then a JSON header)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return {n: tuple(v["shape"]) for n, v in header.items() if n != "__metadata__"}


def adapter_problem(folder: str | Path, lora: LoRASection, shape: ModelShape | None) -> str | None:
    """What keeps the PEFT adapter folder `folder` from starting `lora` on the model of `shape`
    (None: not known here, the tensors' shapes go unchecked), or None when it fits."""
    path = Path(folder)
    if not path.is_dir():
        return f"no adapter folder at {path}"
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        return (
            f"{path} is not a PEFT adapter folder: it has no {ADAPTER_CONFIG} (a LoRA run's "
            "`mtprun export` writes one)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"{config_file} is not readable JSON: {err}"
    problem = _config_problem(config, config_file, lora)
    if problem is None and shape is not None:
        problem = _base_problem(config, config_file, shape)
    if problem is not None:
        return problem
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        return (
            f"{path} has no {ADAPTER_WEIGHTS} (an adapter saved as .bin: load it with peft and "
            "save it again with safe_serialization=True)"
        )
    try:
        found = read_safetensors_shapes(weights)
    except (OSError, ValueError, struct.error) as err:
        return f"{weights} is not a safetensors file: {err}"
    return _tensors_problem(found, weights, lora, shape)


def _config_problem(config: Any, source: Path, lora: LoRASection) -> str | None:
    if not isinstance(config, dict):
        return f"{source} holds no JSON object"
    kind = config.get("peft_type")
    if kind != "LORA":
        return f"{source}: peft_type is {kind!r}: model.lora starts from LoRA adapters only"
    for key, off in _UNSUPPORTED.items():
        value = config.get(key, off)
        if value != off and not (off in ({}, None) and not value):
            return (
                f"{source}: {key} is {value!r}; mtprun's LoRA has no such adapters (it needs "
                f"{key}: {json.dumps(off)})"
            )
    rank = config.get("r")
    if rank != lora.rank:
        return (
            f"{source}: the adapter's rank r is {rank} but model.lora.rank is {lora.rank}: "
            f"set model.lora.rank: {rank}"
        )
    alpha = config.get("lora_alpha", 8)  # peft's default
    if alpha != lora.lora_alpha:
        recipe = "null (2 x rank)" if lora.alpha is None else f"{lora.alpha:g}"
        return (
            f"{source}: the adapter's lora_alpha is {alpha} but model.lora.alpha is {recipe}: "
            f"set model.lora.alpha: {alpha}"
        )
    modules = config.get("target_modules")
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list) or set(modules) != set(lora.modules):
        return (
            f"{source}: the adapter's target_modules are {modules} but model.lora.targets "
            f"{list(lora.targets)} adapt {sorted(lora.modules)}{_targets_hint(modules)}"
        )
    return None


def _targets_hint(modules: Any) -> str:
    """`: set model.lora.targets: [...]` when the recipe can name `modules`, else why not."""
    if not isinstance(modules, list):
        return ""
    targets = [t for t, group in LORA_TARGETS.items() if set(group) <= set(modules)]
    if {m for t in targets for m in LORA_TARGETS[t]} == set(modules):
        return f": set model.lora.targets: [{', '.join(targets)}]"
    return (
        " (targets adapt whole layers: q_proj, k_proj and v_proj together, gate_proj and "
        "up_proj together, and there is no target for other modules)"
    )


def _base_problem(config: dict, source: Path, shape: ModelShape) -> str | None:
    """A base model the config records as a readable local folder of another shape."""
    base = config.get("base_model_name_or_path")
    recorded = ModelShape.read(base) if isinstance(base, str) and base else None
    if recorded is None:  # a hub name, or a folder not readable here: the tensors tell
        return None
    for field in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"):
        theirs, ours = getattr(recorded, field), getattr(shape, field)
        if theirs != ours:
            return (
                f"{source}: the adapter was trained on {base}, whose {field} is {theirs}, but "
                f"the model's is {ours}: the adapter belongs to another base model"
            )
    return None


def _tensors_problem(
    found: dict[str, tuple[int, ...]], source: Path, lora: LoRASection, shape: ModelShape | None
) -> str | None:
    if shape is None:
        return None
    wanted = expected_tensors(shape, lora)
    extra = sorted(set(found) - set(wanted))
    if extra:
        return (
            f"{source} has {len(extra)} tensor(s) the model has no place for, such as "
            f"{extra[0]} (the model has {shape.layers} layers; adapters of "
            f"{', '.join(sorted(lora.modules))}): the adapter belongs to another base model"
        )
    missing = sorted(set(wanted) - set(found))
    if missing:
        return (
            f"{source} lacks {len(missing)} adapter tensor(s) of the model, such as "
            f"{missing[0]}: the adapter belongs to another base model"
        )
    for name, want in wanted.items():
        if found[name] != want:
            return (
                f"{source}: {name} is {list(found[name])} but the model needs {list(want)} "
                "([r, in] for lora_A, [out, r] for lora_B): the adapter belongs to another "
                "base model"
            )
    return None
