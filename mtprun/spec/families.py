"""The model-family registry: the one list of families mtprun supports, each a folder
`mtprun/models/families/<name>/`, and what the recipe language says of each (its
`model.tiny.architecture`, when it has a tiny builder).

A family's folder holds everything that is the family's: the HF architectures it reads, what
it adds to the model shape, its HF <-> Megatron mapping, its layer-spec options, the vLLM
architecture that serves its export, its tiny builder, its renderer. `mtprun.models.families`
loads the folders in this order (a `mtprun.units.Units` extension point: the folder module's
contract is `mtprun.models.family.FamilyUnit`).

Why the list sits here, in the recipe language, and not beside the folders: the recipe's own
rules (`model.tiny`'s architecture names, which of them take experts or MTP layers) run without
importing the models layer (`tests/test_layers.py`: the spec imports only itself, the loss
configs and `mtprun.units`), so the recipe-facing line of each family is part of its registry
entry; `tests/spec/test_model_families.py` holds each entry to its folder. Adding a family is its
folder and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinyArchitecture:
    """A family's tiny random-init builder, as `model.tiny` names and documents it."""

    description: str  # after "<name>: " in `model.tiny.architecture`'s description
    experts: bool = False  # a mixture-of-experts MLP: takes `model.tiny.experts`
    mtp: bool = False  # takes `model.tiny.mtp_layers`
    max_mtp_layers: int | None = None  # the most it takes (None: any number)


@dataclass(frozen=True)
class RegisteredFamily:
    """One family: its folder `mtprun/models/families/<name>/` and its tiny builder's name."""

    name: str  # the folder's name, and the `model.tiny.architecture` of its tiny builder
    tiny: TinyArchitecture | None = None  # None: no tiny builder

    @property
    def module(self) -> str:
        """The folder's import path."""
        return f"mtprun.models.families.{self.name}"


FAMILY_REGISTRY: tuple[RegisteredFamily, ...] = (
    RegisteredFamily("qwen2", TinyArchitecture("a Qwen2 decoder")),
    RegisteredFamily("llama"),
    RegisteredFamily(
        "mimo",
        TinyArchitecture(
            "Qwen2 plus MiMo-style MTP layers (needed for MTP losses and MTP speculative decoding)",
            mtp=True,
        ),
    ),
    RegisteredFamily(
        "qwen3", TinyArchitecture("a Qwen3 decoder (per-head q/k norms, no q/k/v biases)")
    ),
    RegisteredFamily(
        "qwen3_moe",
        TinyArchitecture("Qwen3 attention with a mixture-of-experts MLP (`experts`)", experts=True),
    ),
    RegisteredFamily(
        "glm4_moe",
        TinyArchitecture(
            "GLM-4.5 (a dense first layer, then a sigmoid router over `experts` plus a shared "
            "expert, RoPE on half of each head)",
            experts=True,
            mtp=True,
        ),
    ),
    RegisteredFamily(
        "qwen3_5",
        TinyArchitecture(
            "Qwen3.5's hybrid of Gated DeltaNet layers and, every 4th layer, gated attention "
            "(GDN key heads = kv_heads, value heads = heads, each 64 wide)",
            mtp=True,
            max_mtp_layers=1,
        ),
    ),
)

TINY_ARCHITECTURES: dict[str, TinyArchitecture] = {
    f.name: f.tiny for f in FAMILY_REGISTRY if f.tiny is not None
}
"""`model.tiny.architecture` names, in registry order."""

MOE_ARCHITECTURES = tuple(name for name, t in TINY_ARCHITECTURES.items() if t.experts)
MTP_ARCHITECTURES = tuple(name for name, t in TINY_ARCHITECTURES.items() if t.mtp)


def either(names: tuple[str, ...], last: str = "or") -> str:
    """`a, b or c`."""
    return f" {last} ".join(filter(None, (", ".join(names[:-1]), names[-1]))) if names else ""
