"""`model:` the policy to train: an HF-format folder or a tiny random-init model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mtprun.spec.base import Section

# Attention head sizes vLLM's CPU attention backend accepts (STACK.md): others fail at the
# first generate, long after the recipe was accepted.
VLLM_CPU_HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Like Megatron's make_vocab_size_divisible_by: a tiny model's default vocab is one every usual
# tensor-parallel size (1, 2, 4, 8, ...) divides. The padding ids have embedding and output
# rows like any other token; no text maps to them and the tokenizer decodes them to nothing.
VOCAB_MULTIPLE = 128


MOE_ARCHITECTURES = ("qwen3_moe", "glm4_moe")  # the tiny architectures with experts
MTP_ARCHITECTURES = ("mimo", "glm4_moe")  # the tiny architectures with MTP layers


class TinyExperts(Section):
    """The mixture-of-experts MLP of a tiny MoE model (every layer sparse)."""

    count: int = Field(4, ge=1, description="Routed experts per layer.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    intermediate: int = Field(64, ge=1, description="One expert's MLP intermediate size.")


class TinyModel(Section):
    """A small random-init model built locally (no hub download)."""

    architecture: Literal["qwen2", "qwen3", "qwen3_moe", "glm4_moe", "mimo"] = Field(
        "qwen2",
        description="qwen2: a Qwen2 decoder; qwen3: a Qwen3 decoder (per-head q/k norms, no "
        "q/k/v biases); qwen3_moe: Qwen3 attention with a mixture-of-experts MLP (`experts`); "
        "glm4_moe: GLM-4.5 (a dense first layer, then a sigmoid router over `experts` plus a "
        "shared expert, RoPE on half of each head); "
        "mimo: Qwen2 plus MiMo-style MTP layers (needed for MTP losses and MTP speculative "
        "decoding).",
    )
    hidden: int = Field(128, ge=1, description="Hidden size.")
    layers: int = Field(2, ge=1, description="Number of decoder layers.")
    heads: int = Field(
        4,
        ge=1,
        description="Attention heads. hidden/heads is the head size and must be one vLLM's CPU "
        f"attention accepts: {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}.",
    )
    kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    intermediate: int = Field(256, ge=1, description="MLP intermediate size.")
    vocab: int | None = Field(
        None,
        ge=1,
        description="Vocabulary size; null takes the tokenizer's size rounded up to a multiple "
        f"of {VOCAB_MULTIPLE} (so every usual tensor-parallel size divides it).",
    )
    mtp_layers: int = Field(
        0, ge=0, description="Multi-token-prediction layers (architecture mimo or glm4_moe)."
    )
    tie_embeddings: bool = Field(False, description="Share the input embedding and output layer.")
    max_seq_len: int = Field(512, ge=1, description="Maximum sequence length (positions).")
    experts: TinyExperts | None = Field(
        None,
        description="The experts of a mixture-of-experts architecture (qwen3_moe, glm4_moe); "
        "null there takes the defaults.",
    )

    @model_validator(mode="before")
    @classmethod
    def _experts_default(cls, data: Any) -> Any:
        # An MoE architecture without `experts:` takes TinyExperts' defaults.
        moe = isinstance(data, dict) and data.get("architecture") in MOE_ARCHITECTURES
        return {**data, "experts": {}} if moe and data.get("experts") is None else data

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def vocab_size(self, tokenizer_size: int) -> int:
        """The model's vocab: `vocab`, or the tokenizer's size padded to VOCAB_MULTIPLE."""
        if self.vocab is not None:
            return self.vocab
        return -(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class ModelSection(Section):
    """Exactly one of `path` and `tiny`."""

    path: str | None = Field(
        None,
        description="HF-format model folder (config.json, safetensors, tokenizer); a relative "
        "path is relative to the recipe file that sets it.",
    )
    tiny: TinyModel | None = Field(None, description="Build a tiny random-init model instead.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter and compute dtype of trainer and rollouts."
    )

    @model_validator(mode="after")
    def _path_xor_tiny(self) -> ModelSection:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of `path` (an HF model folder) and `tiny`")
        return self
