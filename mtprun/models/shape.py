"""The one model shape: what validate's rules, `mtprun plan`, the memory estimate, weight
conversion and the trainer know about a model, read from an HF config.json or `model.tiny`.

A shape is a dense decoder core (every supported family today) with room for what newer
families add beside it: `qkv_bias`, `qk_norm` (per-head q/k norms), `experts` for a
mixture-of-experts MLP, `mtp_layers` for multi-token-prediction layers. What a family adds is
declared by its `mtprun.models.family.Family` and read here; a family that needs more (per-layer
kinds of a hybrid model) adds its field here with a default that keeps the dense reading;
every consumer then sees it through this one type. Nothing here names a family: each one's
readings are its folder's (`mtprun.models.families`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtprun.models import folder_tensors
from mtprun.models.expert_shape import ExpertShape
from mtprun.models.families import (
    SUPPORTED_ARCHITECTURES,
    TINY_ARCHITECTURES,
    family_of,
    tiny_family,
)
from mtprun.models.qwen3_5_shape import LINEAR_ATTENTION, LinearAttentionShape, unknown_layer_types

if TYPE_CHECKING:
    from mtprun.spec.model import TinyModel

__all__ = ["SUPPORTED_ARCHITECTURES", "TINY_ARCHITECTURES", "ExpertShape", "ModelShape"]

# The config.json key of each shape field read from one (messages name a field by its key).
HF_CONFIG_KEYS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
    "mtp_layers": "num_nextn_predict_layers",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
}

# What a config.json that leaves a field out means (transformers' defaults for these families).
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_MAX_SEQ_LEN = 2048

# A weight sync or checkpoint takes a model this many decoder layers at a time (its parts,
# `mtprun.models.decoder.part_layers`): the rank that gathers holds their whole tensors (and
# those outside the layers with the first part), not the whole model's.
LAYERS_PER_PART = 2


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only causal LM: the dense core, and the optional parts beside it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2 and MiMo have q/k/v biases
    qk_norm: bool = False  # Qwen3 RMS-normalises each query and key head before RoPE
    mtp_layers: int = 0
    rotary_fraction: float = 1.0  # the share of each head's channels RoPE rotates (GLM: 0.5)
    rms_norm_eps: float = _DEFAULT_RMS_NORM_EPS
    rope_theta: float = _DEFAULT_ROPE_THETA
    max_seq_len: int = _DEFAULT_MAX_SEQ_LEN
    # The supported HF architecture it reads as; None when its config names none mtprun
    # supports (validate and the memory estimate still read its shape).
    architecture: str | None = None
    experts: ExpertShape | None = None
    config_path: str | None = None  # the config.json it was read from; None for model.tiny
    # A hybrid model's token mixer per decoder layer (`mtprun.models.qwen3_5_shape` kinds);
    # empty: every layer is softmax attention. `linear_attention`: its GDN layers' sizes.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionShape | None = None
    output_gate: bool = False  # attention output * sigmoid(gate from q_proj) (Qwen3.5)
    zero_centered_norm: bool = False  # RMSNorm weights w applied as (1 + w) (Qwen3.5)
    # MTP layers config.json declares whose own tensors the folder's weights lack
    # (`with_folder_tensors`): their names. When it lacks all of them (a folder
    # written by transformers, which drops the MTP layer), `absent_mtp_layers` is the declared
    # count and `mtp_layers` 0: none is built, trained or exported. Some of them: `mtp_layers`
    # stays the declared count, and config.json and the weights disagree.
    missing_mtp_tensors: tuple[str, ...] = ()
    absent_mtp_layers: int = 0

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], source: str = "config.json", *, supported_only: bool = True
    ) -> ModelShape:
        """The shape in an HF config.json's fields (`source`: its path, for messages).

        With `supported_only` (what conversion and the trainer need) a config whose
        `architectures` names none mtprun supports, or whose RoPE is not the default one, is a
        ValueError; without it the shape is read whatever the architecture. A missing or
        malformed required field raises KeyError, TypeError or ValueError.
        """
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        rope = config.get("rope_parameters") or {}
        if supported_only and arch is None:
            raise ValueError(
                f"{source}: architectures {archs} has none mtprun supports "
                f"({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if supported_only and rope.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: rope_type {rope['rope_type']!r} is not supported")
        # An architecture mtprun does not support reads as the Qwen2-style core (for the
        # memory estimate): q/k/v biases, no q/k norms.
        family = family_of(arch) if arch else None
        if family and family.text_config:  # a vision-language checkpoint: its text model
            config = {**config, **(config.get("text_config") or {})}
            rope = config.get("rope_parameters") or {}
        layer_types = family.layer_types(config) if family and family.layer_types else ()
        unknown = unknown_layer_types(layer_types)
        if supported_only and unknown:
            raise ValueError(
                f"{source}: layer_types names {unknown}, a layer kind mtprun does not build "
                f"(it builds {', '.join(sorted(set(layer_types) - set(unknown)))})"
            )
        key = HF_CONFIG_KEYS
        hidden, heads = int(config[key["hidden"]]), int(config[key["heads"]])
        return cls(
            hidden=hidden,
            layers=int(config[key["layers"]]),
            heads=heads,
            kv_heads=int(config.get(key["kv_heads"]) or heads),
            head_dim=int(config.get(key["head_dim"]) or hidden // heads),
            intermediate=int(config[key["intermediate"]]),
            vocab=int(config[key["vocab"]]),
            tie_embeddings=bool(config.get(key["tie_embeddings"], False)),
            qkv_bias=family.qkv_bias(config) if family else True,
            qk_norm=family.qk_norm(config) if family else False,
            # Only a family that trains MTP layers has them.
            mtp_layers=int(config.get(family.mtp_layers_key if family else key["mtp_layers"]) or 0)
            if not family or family.mtp
            else 0,
            rotary_fraction=float(
                rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
            ),
            rms_norm_eps=float(config.get(key["rms_norm_eps"], _DEFAULT_RMS_NORM_EPS)),
            rope_theta=float(
                rope.get("rope_theta", config.get(key["rope_theta"], _DEFAULT_ROPE_THETA))
            ),
            max_seq_len=int(config.get(key["max_seq_len"]) or _DEFAULT_MAX_SEQ_LEN),
            architecture=arch,
            experts=family.experts(config) if family and family.experts else None,
            config_path=source,
            layer_types=layer_types,
            linear_attention=(
                family.linear_attention(config) if family and family.linear_attention else None
            ),
            output_gate=bool(family and family.output_gate),
            zero_centered_norm=bool(family and family.zero_centered_norm),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelShape:
        """The shape of an HF model folder mtprun can convert; FileNotFoundError without a
        config.json, ValueError for an architecture it does not support."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json; is {model_dir} an HF model folder?")
        shape = cls.from_hf_config(json.loads(path.read_text()), source=str(path))
        return shape.with_folder_tensors(model_dir)

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelShape | None:
        """The shape in an HF folder's config.json, whatever its architecture; None when it is
        not readable here (for instance a cluster path): its user then skips what needs it,
        and the runner reports the folder with its own, specific error."""
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
            shape = cls.from_hf_config(config, source=str(path), supported_only=False)
        except (OSError, ValueError, KeyError, TypeError, ArithmeticError):
            return None
        return shape.with_folder_tensors(model_dir)

    def with_folder_tensors(self, model_dir: str | Path) -> ModelShape:
        """This shape (read from `model_dir`'s config.json) against the tensors the folder's
        weights hold (safetensors headers or index, `mtprun.models.folder_tensors`; nothing is
        loaded): the declared MTP layers whose own tensors are missing are recorded
        (`missing_mtp_tensors`), and when every one is missing none is built
        (`absent_mtp_layers`). Unchanged when the weights are not readable here."""
        family = family_of(self.architecture) if self.architecture else None
        if not self.mtp_layers or family is None or family.mtp_tensors is None:
            return self
        names = folder_tensors.folder_tensor_names(model_dir)
        if names is None:
            return self
        missing = folder_tensors.missing_mtp_tensors(
            names, family.mtp_tensors, self.layers, self.mtp_layers
        )
        if not missing:
            return self
        expected = sum(len(family.mtp_tensors(self.layers, i)) for i in range(self.mtp_layers))
        if len(missing) < expected:  # some: config.json and the weights disagree
            return replace(self, missing_mtp_tensors=missing)
        return replace(
            self, mtp_layers=0, absent_mtp_layers=self.mtp_layers, missing_mtp_tensors=missing
        )

    @property
    def mtp_layers_key(self) -> str:
        """The config.json key of its MTP layer count (messages name it)."""
        if self.architecture is None:
            return HF_CONFIG_KEYS["mtp_layers"]
        return family_of(self.architecture).mtp_layers_key

    @classmethod
    def from_tiny(cls, tiny: TinyModel, vocab: int) -> ModelShape:
        """The shape of the folder `mtprun.models.tiny` builds from `tiny`, whose vocab is
        `vocab` (`tiny.vocab`, or what a null one becomes: its tokenizer's size, padded)."""
        family = tiny_family(tiny.architecture)
        return cls(
            hidden=tiny.hidden,
            layers=tiny.layers,
            heads=tiny.heads,
            kv_heads=tiny.kv_heads,
            head_dim=tiny.head_dim,
            intermediate=tiny.intermediate,
            vocab=vocab,
            tie_embeddings=tiny.tie_embeddings,
            mtp_layers=tiny.mtp_layers,
            max_seq_len=tiny.max_seq_len,
            qkv_bias=family.qkv_bias({}),  # a tiny config leaves `attention_bias` unset
            qk_norm=family.qk_norm({}),  # a tiny config leaves `use_qk_norm` unset
            architecture=family.architecture,
            experts=_tiny_experts(tiny) if family.experts else None,
            output_gate=family.output_gate,
            zero_centered_norm=family.zero_centered_norm,
            # The family's own: RoPE share, layer kinds, linear attention sizes.
            **(family.tiny_shape(tiny) if family.tiny_shape else {}),
        )

    def is_linear_attention_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (0-based) is a Gated DeltaNet layer."""
        return bool(self.layer_types) and self.layer_types[index] == LINEAR_ATTENTION

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (0-based) has a mixture-of-experts MLP."""
        return self.experts is not None and self.experts.is_moe_layer(index)

    def megatron_layer_options(self) -> dict[str, Any]:
        """Keyword options of megatron-core's `get_gpt_layer_local_spec` (and the same-named
        `TransformerConfig` fields) that this model's family needs."""
        return {"qk_layernorm": self.qk_norm, "attention_output_gate": self.output_gate}

    def check_tp(self, tp: int) -> None:
        """Raise a clear error when this model cannot be split over `tp` ranks."""
        for field in ("heads", "kv_heads", "vocab", "intermediate"):
            n = getattr(self, field)
            if n % tp:
                raise ValueError(
                    f"parallel.tp={tp} does not divide the model's {HF_CONFIG_KEYS[field]}={n}; "
                    "choose a tp that divides it (for a tiny model, change model.tiny accordingly)"
                )
        linear = self.linear_attention
        if linear is not None and (linear.key_heads % tp or linear.value_heads % tp):
            raise ValueError(
                f"parallel.tp={tp} does not divide the model's linear_num_key_heads="
                f"{linear.key_heads} and linear_num_value_heads={linear.value_heads}; choose a "
                "tp that divides both"
            )
        shared = self.experts.shared_intermediate if self.experts else 0
        if shared % tp:
            raise ValueError(
                f"parallel.tp={tp} does not divide the model's shared-expert width {shared} "
                "(n_shared_experts x moe_intermediate_size); choose a tp that divides it"
            )

    def check_ep(self, ep: int) -> None:
        """Raise a clear error when this model's experts cannot be split over `ep` ranks."""
        if ep == 1:
            return
        if self.experts is None:
            raise ValueError(
                f"parallel.ep={ep} splits the experts of a mixture-of-experts model, and this "
                "model has none; set parallel.ep: 1"
            )
        if self.experts.count % ep:
            raise ValueError(
                f"parallel.ep={ep} does not divide the model's {self.experts.count} experts; "
                "choose an ep that divides them"
            )


def _tiny_experts(tiny: TinyModel) -> ExpertShape:
    """The experts `mtprun.models.tiny` builds: Qwen3-MoE's router (top-k renormalised)."""
    moe = tiny.experts
    return ExpertShape(count=moe.count, top_k=moe.top_k, intermediate=moe.intermediate)
