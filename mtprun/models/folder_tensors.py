"""Which tensors an HF model folder holds, read from its safetensors headers (or, without
weight files, its `*.safetensors.index.json`): no tensor is loaded and torch is not imported,
so `mtprun validate` reads it too.

Its use: a family with MTP layers (MiMo, GLM-4.5, Qwen3.5) declares their count in
config.json, but a folder that went through transformers lacks their tensors (transformers
neither builds nor saves the MTP layer, and keeps the config's count). `missing_mtp_tensors`
names the declared MTP layers' own tensors (norms and input projection, which every such
checkpoint holds) that the folder lacks; `mtprun.models.shape.ModelShape` then builds none
when the folder holds none of them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

# A safetensors file starts with the byte length of its JSON header (little-endian u64).
_HEADER_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def safetensors_names(path: Path) -> set[str]:
    """The tensor names in one safetensors file's header (ValueError when it is not one)."""
    with Path(path).open("rb") as f:
        prefix = f.read(_HEADER_LENGTH.size)
        if len(prefix) != _HEADER_LENGTH.size:
            raise ValueError(f"{path}: too short for a safetensors file")
        (length,) = _HEADER_LENGTH.unpack(prefix)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors header")
    return {name for name in header if name != "__metadata__"}


def folder_tensor_names(model_dir: str | Path) -> frozenset[str] | None:
    """Every tensor name of the folder's weights: the headers of its `*.safetensors` files (the
    files the trainer loads), else its safetensors index's `weight_map`. None when neither is
    readable here (no weights, a cluster path, Git LFS pointers): nothing is concluded then."""
    folder = Path(model_dir)
    try:
        files = sorted(folder.glob("*.safetensors"))
        if files:
            names: set[str] = set()
            for path in files:
                names |= safetensors_names(path)
            return frozenset(names)
        for index in sorted(folder.glob("*.safetensors.index.json")):
            return frozenset(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


# The own tensors (HF names) of MTP layer i of a family's layout (`Family.mtp_tensors`),
# `layers` being the config's num_hidden_layers; the decoder layer inside it is checked by
# conversion.
MtpTensors = Callable[[int, int], tuple[str, ...]]


def missing_mtp_tensors(
    names: frozenset[str], tensors: MtpTensors, layers: int, mtp_layers: int
) -> tuple[str, ...]:
    """The own tensors of the `mtp_layers` declared MTP layers that `names` lacks, in order."""
    expected = (name for i in range(mtp_layers) for name in tensors(layers, i))
    return tuple(name for name in expected if name not in names)
