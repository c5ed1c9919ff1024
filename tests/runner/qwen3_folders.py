"""Qwen3 folders for the Qwen3 tests: the tiny builder's, reshaped so that head_dim differs
from hidden / heads, with every RMSNorm weight random (a swapped q/k norm would not show with
the all-ones weights of a fresh init)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Glm4MoeForCausalLM,
    PreTrainedTokenizerBase,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from mtprun.models import build_tiny_model
from mtprun.spec.model import TinyExperts, TinyModel

from .conftest import TINY


def build_qwen3_folder(
    tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int, tie: bool = False
) -> Path:
    """A random-init Qwen3 of hidden 64 with 4 query heads and 2 key/value heads of 32
    channels (queries 128 wide), every norm weight drawn around 1."""
    spec = TinyModel(architecture="qwen3", tie_embeddings=tie, **TINY)
    folder = build_tiny_model(spec, tokenizer, out_dir, seed=seed)
    config = AutoConfig.from_pretrained(folder)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 32
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    tensors = {n: t.detach().clone() for n, t in model.state_dict().items()}
    for name, tensor in tensors.items():
        if "norm" in name:
            tensor.copy_(1.0 + 0.2 * torch.randn_like(tensor))
    if tie:
        del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    return folder


def build_qwen3_moe_folder(tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int) -> Path:
    """A random-init Qwen3-MoE of hidden 64: layer 0 dense (`mlp_only_layers`), layer 1 with 4
    experts of width 32, top-2 renormalised; norms drawn around 1, the router at a scale where
    tokens spread over the experts."""
    experts = TinyExperts(count=4, top_k=2, intermediate=32)
    spec = TinyModel(architecture="qwen3_moe", experts=experts, **TINY)
    folder = build_tiny_model(spec, tokenizer, out_dir, seed=seed)
    config = AutoConfig.from_pretrained(folder)
    config.mlp_only_layers = [0]
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.copy_(1.0 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def build_glm4_moe_folder(tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int) -> Path:
    """A random-init GLM-4.5 of hidden 64 exercising each of its options: layer 0 dense
    (`first_k_dense_replace`), layer 1 with 4 routed experts of width 32 in 2 groups (the best
    group kept, `topk_group` 1), top-2 sigmoid routing with a random correction bias and
    `routed_scaling_factor` 2.5, a shared expert, q/k/v biases, q/k norms, RoPE on half of
    each head (no MTP layer: `test_glm4_moe.py` builds one on its own)."""
    experts = TinyExperts(count=4, top_k=2, intermediate=32)
    spec = TinyModel(architecture="glm4_moe", experts=experts, **TINY)
    folder = build_tiny_model(spec, tokenizer, out_dir, seed=seed)
    config = AutoConfig.from_pretrained(folder)
    config.n_group, config.topk_group, config.routed_scaling_factor = 2, 1, 2.5
    config.attention_bias, config.use_qk_norm = True, True
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.copy_(1.0 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith(".bias"):
                tensor.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def assert_logits_equal_transformers(model: torch.nn.Module, folder: Path) -> None:
    """A Megatron-core model (mtprun's PolicyModel, on the folder's weights) gives the logits
    transformers gives on 24 seeded random tokens, within 1e-5 (float32, causal mask)."""
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(11))
    causal = torch.triu(torch.ones(24, 24, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        got = model.eval()(ids, torch.arange(24)[None], causal)
        want = reference(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
