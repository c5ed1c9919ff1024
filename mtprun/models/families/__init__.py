"""The model families: one folder each (`mtprun/models/families/<name>/`), loaded in the order
of their registry (`mtprun.spec.families`), and every list of architectures derived from them.

`FAMILY_UNITS` is the extension point (`mtprun.units`): each folder's `__init__` satisfies
`mtprun.models.family.FamilyUnit` (`NAME`, and `FAMILIES`: a `Family` per HF architecture it
reads). The supported architectures, the `model.tiny.architecture` names, the conversion
dispatch, the trainer's MTP wiring, the rollout engine's vLLM arguments and the renderer of a
folder all come from here. Nothing here imports torch: `mtprun validate` reads shapes through
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtprun.models.family import Family, FamilyUnit
from mtprun.spec.families import FAMILY_REGISTRY
from mtprun.units import Units, register_point

FAMILY_UNITS: Units[FamilyUnit] = register_point(
    Units("model family", FamilyUnit, tuple(f.module for f in FAMILY_REGISTRY))
)

FAMILIES: tuple[Family, ...] = tuple(f for unit in FAMILY_UNITS for f in unit.FAMILIES)
"""Every family (one per HF architecture), in registry order."""

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(f.architecture for f in FAMILIES)
"""HF `architectures` entries whose weights mtprun can convert to Megatron-core and back."""

TINY_ARCHITECTURES: dict[str, str] = {f.tiny: f.architecture for f in FAMILIES if f.tiny}
"""The HF architecture each `model.tiny.architecture` builds."""

_BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES}


def family_of(architecture: str) -> Family:
    """The family of a supported HF architecture (KeyError for any other)."""
    return _BY_ARCHITECTURE[architecture]


def tiny_family(name: str) -> Family:
    """The family a `model.tiny.architecture` name builds."""
    return family_of(TINY_ARCHITECTURES[name])


def family_of_config(config: Mapping[str, Any]) -> Family | None:
    """The family of a config.json's first supported `architectures` entry, None if none is."""
    archs = config.get("architectures") or ()
    return next((_BY_ARCHITECTURE[a] for a in archs if a in _BY_ARCHITECTURE), None)
