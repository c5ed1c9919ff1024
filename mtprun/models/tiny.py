"""Tiny random-init HF checkpoints of every family with a tiny builder (`Family.tiny`: Qwen2,
Qwen3, Qwen3-MoE, GLM-4.5, MiMo = Qwen2 + MTP layers, Qwen3.5), built locally.

The folder holds config.json, model.safetensors and the tokenizer, and loads in transformers
(`AutoModelForCausalLM`) and in vLLM. The family (`mtprun.models.families`) names the
transformers config class it draws from, the config fields it adds, and the module that draws
its MTP layers' own tensors. A MiMo folder declares `"architectures": ["MiMoForCausalLM"]` and
`num_nextn_predict_layers`; vLLM then serves its MTP layers as the speculative-decoding
drafter, while transformers loads the trunk as a plain Qwen2 model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from mtprun.models.families import tiny_family
from mtprun.models.family import load
from mtprun.spec.families import MTP_ARCHITECTURES, either
from mtprun.spec.model import VLLM_CPU_HEAD_DIMS, TinyModel


def tiny_config(spec: TinyModel, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The HF config of `spec`'s family at `spec`'s sizes, for `tokenizer`'s special ids."""
    family = tiny_family(spec.architecture)
    if spec.hidden % spec.heads or spec.head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(
            f"model.tiny: hidden={spec.hidden} / heads={spec.heads} must be a head size vLLM's "
            f"CPU attention accepts ({', '.join(map(str, VLLM_CPU_HEAD_DIMS))})"
        )
    if spec.heads % spec.kv_heads:
        raise ValueError(f"model.tiny: heads={spec.heads} must be a multiple of kv_heads")
    if spec.mtp_layers and not family.mtp:
        names = either(MTP_ARCHITECTURES)
        raise ValueError(f"model.tiny: mtp_layers needs architecture: {names}")
    vocab = spec.vocab_size(len(tokenizer))
    if vocab < len(tokenizer):
        raise ValueError(
            f"model.tiny.vocab={vocab} is smaller than the tokenizer ({len(tokenizer)})"
        )
    config = getattr(transformers, family.tiny_config)(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_seq_len,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # Explicit for every family (Qwen3's config defaults to 128; vLLM's GLM-4.5 reads it with
    # no fallback, as the released GLM configs carry it).
    config.head_dim = spec.head_dim
    config.architectures = [family.architecture]
    for name, value in (family.tiny_fields(spec) if family.tiny_fields else {}).items():
        setattr(config, name, value)
    if family.mtp:
        setattr(config, family.mtp_layers_key, spec.mtp_layers)
    return config


def build_tiny_model(
    spec: TinyModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int
) -> Path:
    """Write a random-init model folder (config, safetensors, tokenizer) to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(spec, tokenizer)
    family = tiny_family(spec.architecture)
    # A DeepSeek-style MTP layer's decoder layer is stored as one more decoder layer.
    extra_layers = spec.mtp_layers if family.mtp_in_decoder_layers else 0
    config.num_hidden_layers += extra_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # transformers writes its checkpoint layout (per-expert MoE tensors, a tied output layer
    # stored once as the embedding), which is what vLLM and mtprun read.
    model.save_pretrained(out_dir)
    config.num_hidden_layers -= extra_layers
    (out_dir / "generation_config.json").unlink(missing_ok=True)  # sampling is the recipe's
    if spec.mtp_layers:
        weights = out_dir / "model.safetensors"
        own = load(family.tiny_mtp_tensors)  # the family's MTP layers' own tensors
        tensors = {**load_file(str(weights)), **own(config, spec.mtp_layers)}
        save_file(tensors, str(weights), metadata={"format": "pt"})
    # save_pretrained names the transformers class it saved (Qwen2 for MiMo): name the family.
    config.architectures = [family.architecture]
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
