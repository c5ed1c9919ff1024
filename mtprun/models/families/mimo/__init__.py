"""MiMo (`MiMoForCausalLM`): Qwen2 plus MTP layers under `model.mtp_layers.{i}.`, trained by
mtprun and served as vLLM's `mtp` drafter (its input [hidden, embedding], pre-norm hidden).

Submodules (torch): `convert` maps the MTP layers' tensors, `tiny` draws them for a tiny model.
"""

from __future__ import annotations

from mtprun.models.family import DECODER, Family, always

NAME = "mimo"


def mtp_tensors(layers: int, i: int) -> tuple[str, ...]:
    """The own tensors of MTP layer i: `model.mtp_layers.{i}.` (`convert`)."""
    own = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    return tuple(f"model.mtp_layers.{i}.{name}.weight" for name in own)


FAMILIES = (
    Family(
        "MiMoForCausalLM",
        "MiMoForCausalLM",  # and its MTP layers as vLLM's `mtp` drafter
        qkv_bias=always,
        mtp=True,
        mtp_tensors=mtp_tensors,
        converters=(DECODER, f"{__name__}.convert"),
        tiny=NAME,
        tiny_mtp_tensors=f"{__name__}.tiny:mtp_tensors",
    ),
)
