"""`model:` the policy to train: an HF-format folder or a tiny random-init model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mtprun.spec.base import Section
from mtprun.spec.families import MOE_ARCHITECTURES, MTP_ARCHITECTURES, TINY_ARCHITECTURES, either

# Attention head sizes vLLM's CPU attention backend accepts (docs/stack.md): others fail at the
# first generate, long after the recipe was accepted.
VLLM_CPU_HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Like Megatron's make_vocab_size_divisible_by: a tiny model's default vocab is one every usual
# tensor-parallel size (1, 2, 4, 8, ...) divides. The padding ids have embedding and output
# rows like any other token; no text maps to them and the tokenizer decodes them to nothing.
VOCAB_MULTIPLE = 128


# The tiny architectures (`mtprun.spec.families`: one per family with a tiny builder).
TinyArchitectureName = Literal[tuple(TINY_ARCHITECTURES)]  # type: ignore[valid-type]
_MTP_LIMITS = "".join(
    f"; {name} takes at most {t.max_mtp_layers}"
    for name, t in TINY_ARCHITECTURES.items()
    if t.mtp and t.max_mtp_layers is not None
)


class TinyExperts(Section):
    """The mixture-of-experts MLP of a tiny MoE model (every layer sparse)."""

    count: int = Field(4, ge=1, description="Routed experts per layer.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    intermediate: int = Field(64, ge=1, description="One expert's MLP intermediate size.")


class TinyModel(Section):
    """A small random-init model built locally (no hub download)."""

    architecture: TinyArchitectureName = Field(
        "qwen2",
        description="; ".join(f"{name}: {t.description}" for name, t in TINY_ARCHITECTURES.items())
        + ".",
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
        0,
        ge=0,
        description=f"Multi-token-prediction layers (architecture {either(MTP_ARCHITECTURES)}"
        f"{_MTP_LIMITS}).",
    )
    tie_embeddings: bool = Field(False, description="Share the input embedding and output layer.")
    max_seq_len: int = Field(512, ge=1, description="Maximum sequence length (positions).")
    experts: TinyExperts | None = Field(
        None,
        description="The experts of a mixture-of-experts architecture "
        f"({', '.join(MOE_ARCHITECTURES)}); null there takes the defaults.",
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


# `model.lora.targets`: the trunk's linear layers (Megatron's names) and the HF modules each
# one holds (peft's target modules: one adapter per HF module, so a PEFT adapter maps one to
# one). `all` is every one of them.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "proj": ("o_proj",),
    "fc1": ("gate_proj", "up_proj"),
    "fc2": ("down_proj",),
}
LoRATarget = Literal["qkv", "proj", "fc1", "fc2", "all"]


class LoRASection(Section):
    """Low-rank adapters (LoRA) on the policy's decoder linear layers; every base weight is
    frozen and only the adapters train (peft's LoRA: W x + alpha / rank B A dropout(x))."""

    rank: int = Field(16, ge=1, description="Adapter rank r (A is [r, in], B is [out, r]).")
    alpha: float | None = Field(
        None,
        gt=0,
        description="LoRA alpha: the adapters' output is scaled by alpha / rank; null takes "
        "2 x rank.",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on each adapter's input (training only)."
    )
    targets: list[LoRATarget] = Field(
        default_factory=lambda: ["all"],
        min_length=1,
        description="The decoder's linear layers that get adapters: qkv (q_proj, k_proj, "
        "v_proj: one adapter each), proj (o_proj), fc1 (gate_proj, up_proj: one each), fc2 "
        "(down_proj), or all of them. MTP layers, embeddings, norms and the output layer stay "
        "frozen.",
    )
    path: str | None = Field(
        None,
        description="A PEFT LoRA adapter folder to start from (adapter_config.json, "
        "adapter_model.safetensors; a LoRA run's `mtprun export`), relative to the recipe file "
        "that sets it; its rank, alpha and target modules must be this section's, its tensors "
        "the model's shapes. Null: fresh adapters (B = 0, the base model's outputs).",
    )

    @property
    def lora_alpha(self) -> float:
        """alpha, or 2 x rank when it is null (peft's lora_alpha)."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @property
    def scaling(self) -> float:
        """alpha / rank, peft's scaling of the adapters' output."""
        return self.lora_alpha / self.rank

    @property
    def layers(self) -> tuple[str, ...]:
        """The targeted layers (qkv, proj, fc1, fc2), `all` expanded, in that order."""
        chosen = set(LORA_TARGETS) if "all" in self.targets else set(self.targets)
        return tuple(t for t in LORA_TARGETS if t in chosen)

    @property
    def modules(self) -> tuple[str, ...]:
        """The HF modules (peft's target_modules) that get adapters."""
        return tuple(m for t in self.layers for m in LORA_TARGETS[t])


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
    lora: LoRASection | None = Field(
        None,
        description="Train low-rank adapters (LoRA) on the frozen policy instead of every "
        "weight; rollouts get the merged weights, checkpoints and exports a PEFT adapter "
        "folder (`mtprun export --merge`: the merged HF folder).",
    )

    @model_validator(mode="after")
    def _path_xor_tiny(self) -> ModelSection:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of `path` (an HF model folder) and `tiny`")
        return self
