"""LoRA (`model.lora`): the trainer's adapters against peft's on transformers (log-probs and
adapter gradients, float32 on CPU), the frozen base, merged weights for rollouts and export.
tp=2 against one process: test_lora_layouts.py (one spawned pair of processes for every
layout)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtprun.compiler import compile_recipe
from mtprun.models.lora import is_adapter, peft_name
from mtprun.preflight.memory import lora_layer_params
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch

LORA = {"rank": 4, "alpha": 12, "targets": ["all"]}
ADAMW = {"optimizer": "adamw", "lr": 1e-2, "grad_clip": None}


def _trainer(model_dir, lora=LORA, **sections):
    recipe = make_recipe(model_dir, model={"path": str(model_dir), "lora": lora}, **sections)
    return Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")


def _adapters(trainer):
    return {n: p for n, p in trainer.model.named_parameters() if is_adapter(n)}


def _randomize_adapters(trainer, seed):
    """Nonzero B (and fresh A) so that the adapters change the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(_adapters(trainer).items()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _peft_model(model_dir, trainer, lora):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,
        target_modules=list(lora.modules),
    )
    model = get_peft_model(base, config)
    params = dict(model.named_parameters())
    adapters = _adapters(trainer)
    assert len(adapters) == sum(1 for n in params if ".lora_" in n)
    with torch.no_grad():
        for name, p in adapters.items():
            params[_live(peft_name(name))].copy_(p)
    return model


def _live(name):
    """A PEFT file's adapter name -> the live peft model's (adapter `default`)."""
    return name.removesuffix(".weight") + ".default.weight"


def _packed_logprobs(model, batch):
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    logits = torch.cat([model(s[None]).logits[0] for s in batch.input_ids.split(lengths)])
    logp = logits.float().log_softmax(-1).gather(-1, batch.targets[:, None])[:, 0]
    return torch.where(batch.loss_mask, logp, 0.0)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_lora_equals_peft(request, megatron_tp1, fixture):
    folder = request.getfixturevalue(fixture)
    trainer = _trainer(folder, trainer=ADAMW)
    lora = trainer.recipe.model.lora
    assert lora.scaling == 3.0
    names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert names == set(_adapters(trainer)) and names  # the base is frozen
    count = sum(p.numel() for p in _adapters(trainer).values())
    assert count == trainer.shape.layers * lora_layer_params(trainer.shape, 1, lora)  # plan's
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n not in names}
    _randomize_adapters(trainer, seed=1)
    peft = _peft_model(folder, trainer, lora)

    batch = random_packed_batch(trainer.shape.vocab, [13, 19], seed=3)
    (got,) = trainer.logprobs([batch])
    with torch.no_grad():
        want = _packed_logprobs(peft.eval(), batch)
        with peft.disable_adapter():
            plain = _packed_logprobs(peft, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-2  # the adapters matter

    # One step: the token-mean CE over the trained tokens, as the trainer's ce term.
    peft.train()
    loss = -_packed_logprobs(peft, batch)[batch.loss_mask].mean()
    loss.backward()
    metrics = trainer.train_step([batch])
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    peft_params = dict(peft.named_parameters())
    for name, p in _adapters(trainer).items():
        want_grad = peft_params[_live(peft_name(name))].grad
        torch.testing.assert_close(p.grad, want_grad, rtol=1e-4, atol=1e-6, msg=name)
    # Only the adapters moved.
    for name, p in trainer.model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name


def test_lora_merged_weights_score_like_the_adapters(megatron_tp1, tiny_qwen3_dir, tmp_path):
    from mtprun.runner.policy_folder import save_hf_folder

    trainer = _trainer(tiny_qwen3_dir, lora={"rank": 8, "targets": ["qkv", "fc2"]}, trainer=ADAMW)
    assert trainer.recipe.model.lora.modules == ("q_proj", "k_proj", "v_proj", "down_proj")
    vocab = trainer.shape.vocab
    batches = [random_packed_batch(vocab, [9, 14], 4), random_packed_batch(vocab, [20], 5)]
    for _ in range(2):
        trainer.train_step(batches)
    assert all(p.abs().sum() > 0 for n, p in _adapters(trainer).items() if n.endswith("B"))
    # Rollouts and exports get merged weights: transformers scores as the trainer does.
    state = trainer.hf_state_dict()
    assert not any("lora" in name for name in state)
    exported = save_hf_folder(state, tiny_qwen3_dir, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    (got,) = trainer.logprobs([batches[0]])
    with torch.no_grad():
        want = _packed_logprobs(model, batches[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_lora_gradients_survive_recomputation(megatron_tp1, tiny_qwen2_dir, recompute):
    """MLP-only adapters under recomputation: the recomputed block's input comes from frozen
    layers, and the adapters still get their gradients."""
    lora = {"rank": 4, "targets": ["fc1", "fc2"]}
    grads = []
    for mode in ("none", recompute):
        trainer = _trainer(tiny_qwen2_dir, lora=lora, trainer={**ADAMW, "recompute": mode})
        _randomize_adapters(trainer, seed=2)
        trainer.train_step([random_packed_batch(trainer.shape.vocab, [12, 15], seed=7)])
        grads.append({n: p.grad for n, p in _adapters(trainer).items()})
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
