"""Tiny random-init HF checkpoints of every family with a tiny builder (Qwen2, Qwen3,
Qwen3-MoE, or MiMo = Qwen2 + MTP layers), built locally.

The folder holds config.json, model.safetensors and the tokenizer, and loads in transformers
(`AutoModelForCausalLM`) and in vLLM. The family (`mtprun.models.family`) names the
transformers config class it draws from. A MiMo folder declares `"architectures":
["MiMoForCausalLM"]` and `num_nextn_predict_layers`; vLLM then serves its MTP layers as the
speculative-decoding drafter, while transformers loads the trunk as a plain Qwen2 model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

from mtprun.models.family import TINY_ARCHITECTURES, family_of
from mtprun.models.qwen3_5_shape import FULL_ATTENTION
from mtprun.models.shape import tiny_linear_attention
from mtprun.spec.model import VLLM_CPU_HEAD_DIMS, TinyModel


def tiny_config(spec: TinyModel, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The HF config of `spec`'s family at `spec`'s sizes, for `tokenizer`'s special ids."""
    family = family_of(TINY_ARCHITECTURES[spec.architecture])
    if spec.hidden % spec.heads or spec.head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(
            f"model.tiny: hidden={spec.hidden} / heads={spec.heads} must be a head size vLLM's "
            f"CPU attention accepts ({', '.join(map(str, VLLM_CPU_HEAD_DIMS))})"
        )
    if spec.heads % spec.kv_heads:
        raise ValueError(f"model.tiny: heads={spec.heads} must be a multiple of kv_heads")
    if spec.mtp_layers and not family.mtp:
        raise ValueError("model.tiny: mtp_layers needs architecture: mimo, glm4_moe or qwen3_5")
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
    if family.experts:
        for name, value in _expert_fields(spec).items():
            setattr(config, name, value)
    if family.mtp:
        setattr(config, family.mtp_layers_key, spec.mtp_layers)
    if family.linear_attention:
        linear = tiny_linear_attention(spec)
        config.linear_num_key_heads, config.linear_num_value_heads = (
            linear.key_heads,
            linear.value_heads,
        )
        config.linear_key_head_dim, config.linear_value_head_dim = linear.key_dim, linear.value_dim
        config.linear_conv_kernel_dim = linear.conv_kernel
    return config


def _expert_fields(spec: TinyModel) -> dict[str, object]:
    """The config.json fields of a tiny MoE family's experts (every layer sparse, except
    GLM-4.5's first when there are several, as its `first_k_dense_replace` keeps dense)."""
    experts = spec.experts
    common = {
        "num_experts_per_tok": experts.top_k,
        "moe_intermediate_size": experts.intermediate,
        "norm_topk_prob": True,  # as the released checkpoints
    }
    if spec.architecture == "glm4_moe":
        return {
            **common,
            "n_routed_experts": experts.count,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1 if spec.layers > 1 else 0,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
        }
    return {**common, "num_experts": experts.count, "decoder_sparse_step": 1, "mlp_only_layers": []}


def random_mtp_layers(config: Qwen2Config, count: int) -> dict[str, torch.Tensor]:
    """MiMo MTP layer tensors, initialised like the trunk (normal(0, initializer_range))."""
    hidden, std = config.hidden_size, config.initializer_range
    tensors = {}
    for i in range(count):
        prefix = f"model.mtp_layers.{i}."
        layer = Qwen2DecoderLayer(config, layer_idx=0)  # shapes only; values are redrawn
        params = {n: p.detach() for n, p in layer.state_dict().items()}
        params["token_layernorm.weight"] = torch.empty(hidden)
        params["hidden_layernorm.weight"] = torch.empty(hidden)
        params["final_layernorm.weight"] = torch.empty(hidden)
        params["input_proj.weight"] = torch.empty(hidden, 2 * hidden)
        for name, t in params.items():
            if "norm" in name:
                t = torch.ones_like(t)
            elif name.endswith(".bias"):
                t = torch.zeros_like(t)
            else:
                t = torch.randn_like(t) * std
            tensors[prefix + name] = t.contiguous()
    return tensors


def deepseek_mtp_norms(config: PretrainedConfig, count: int) -> dict[str, torch.Tensor]:
    """The own tensors of DeepSeek-V3-style MTP layers (GLM-4.5): `enorm`, `hnorm`,
    `shared_head.norm` (ones) and `eh_proj` (normal(0, initializer_range)) of each, under
    `model.layers.{num_hidden_layers + i}.`; their decoder layers are drawn as extra decoder
    layers of the model (`build_tiny_model`)."""
    hidden, std = config.hidden_size, config.initializer_range
    tensors = {}
    for i in range(count):
        prefix = f"model.layers.{config.num_hidden_layers + i}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(hidden)
        tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * std
    return tensors


def qwen3_5_mtp_layers(config: PretrainedConfig, count: int) -> dict[str, torch.Tensor]:
    """Qwen3.5 MTP tensors under `mtp.` (vLLM's `Qwen3_5MTP` layout): `fc` [H, 2H] and the
    gated attention layers `layers.{i}.` (normal(0, initializer_range)), the zero-centred norms
    `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm` and the layers' own at 0."""
    hidden, std = config.hidden_size, config.initializer_range
    layer_config = copy.deepcopy(config)
    layer_config.layer_types = [FULL_ATTENTION] * config.num_hidden_layers
    tensors = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden) * std}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    for i in range(count):
        layer = Qwen3_5DecoderLayer(layer_config, layer_idx=0)  # shapes only; values redrawn
        for name, t in layer.state_dict().items():
            drawn = torch.zeros_like(t) if "norm" in name else torch.randn_like(t) * std
            tensors[f"mtp.layers.{i}.{name}"] = drawn.contiguous()
    return tensors


# Each tiny architecture's MTP tensors beside the trunk's.
_TINY_MTP_LAYERS = {
    "mimo": random_mtp_layers,
    "glm4_moe": deepseek_mtp_norms,
    "qwen3_5": qwen3_5_mtp_layers,
}


def build_tiny_model(
    spec: TinyModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int
) -> Path:
    """Write a random-init model folder (config, safetensors, tokenizer) to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(spec, tokenizer)
    family = family_of(TINY_ARCHITECTURES[spec.architecture])
    # A DeepSeek-style MTP layer's decoder layer is stored as one more decoder layer.
    extra_layers = spec.mtp_layers if spec.architecture == "glm4_moe" else 0
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
        own = _TINY_MTP_LAYERS[spec.architecture]
        tensors = {**load_file(str(weights)), **own(config, spec.mtp_layers)}
        save_file(tensors, str(weights), metadata={"format": "pt"})
    # save_pretrained names the transformers class it saved (Qwen2 for MiMo): name the family.
    config.architectures = [family.architecture]
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
