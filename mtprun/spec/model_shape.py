"""The model dimensions cross-field rules check: from `model.tiny`, or an HF folder's config."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mtprun.spec.model import ModelSection

# HF config.json keys of the TinyModel fields the rules read.
CONFIG_KEYS = {
    "hidden": "hidden_size",
    "vocab": "vocab_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "mtp_layers": "num_nextn_predict_layers",
    "max_seq_len": "max_position_embeddings",
}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    vocab: int | None  # None: the tokenizer's size (tiny models)
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    mtp_layers: int
    max_seq_len: int
    config: str | None = None  # the config.json it was read from; None for a tiny model

    def label(self, field: str) -> str:
        """How messages name `field`: model.tiny.heads, or .../config.json num_attention_heads."""
        return (
            f"model.tiny.{field}" if self.config is None else f"{self.config} {CONFIG_KEYS[field]}"
        )


def model_shape(model: ModelSection) -> ModelShape | None:
    """The shape of the recipe's model; None when an HF folder's config.json is not readable here
    (for instance a cluster path), in which case the rules that need it are skipped."""
    tiny = model.tiny
    if tiny is not None:
        return ModelShape(
            hidden=tiny.hidden,
            vocab=tiny.vocab,
            heads=tiny.heads,
            kv_heads=tiny.kv_heads,
            intermediate=tiny.intermediate,
            layers=tiny.layers,
            mtp_layers=tiny.mtp_layers,
            max_seq_len=tiny.max_seq_len,
        )
    return folder_shape(model.path or "")


def folder_shape(path: str) -> ModelShape | None:
    """The shape in an HF folder's config.json; None when it is not readable here."""
    config = os.path.join(path, "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            fields = json.load(f)
        heads = int(fields["num_attention_heads"])
        return ModelShape(
            hidden=int(fields["hidden_size"]),
            vocab=int(fields["vocab_size"]),
            heads=heads,
            kv_heads=int(fields.get("num_key_value_heads") or heads),
            intermediate=int(fields["intermediate_size"]),
            layers=int(fields["num_hidden_layers"]),
            mtp_layers=int(fields.get("num_nextn_predict_layers") or 0),
            max_seq_len=int(fields.get("max_position_embeddings") or 2048),
            config=config,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the runner reports an unusable folder with its own, specific error
