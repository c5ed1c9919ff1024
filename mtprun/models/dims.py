"""The shape of a supported HF causal LM, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF `architectures` entries whose weights mtprun can convert to Megatron-core and back.
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MiMoForCausalLM")


@dataclass(frozen=True)
class ModelDims:
    """Everything conversion and model building need to know about one checkpoint."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    qkv_bias: bool
    mtp_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_seq_len: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelDims:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: architectures {archs} has none mtprun supports "
                f"({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: rope_type {rope['rope_type']!r} is not supported")
        return cls(
            architecture=arch,
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama has them when `attention_bias` is set.
            qkv_bias=arch != "LlamaForCausalLM" or bool(config.get("attention_bias", False)),
            mtp_layers=int(config.get("num_nextn_predict_layers", 0) or 0),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelDims:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json; is {model_dir} an HF model folder?")
        return cls.from_hf_config(json.loads(path.read_text()), source=str(path))

    def check_tp(self, tp: int) -> None:
        """Raise a clear error when this model cannot be split over `tp` ranks."""
        for what, n in (
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("vocab_size", self.vocab),
            ("intermediate_size", self.intermediate),
        ):
            if n % tp:
                raise ValueError(
                    f"parallel.tp={tp} does not divide the model's {what}={n}; choose a tp that "
                    f"divides it (for a tiny model, change model.tiny accordingly)"
                )
