"""Qwen3 (per-head q/k norms, no q/k/v biases, head_dim apart from hidden / heads) through
conversion, the trainer against transformers, export, and tp=2 against one process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.models.tp_layout import unshard
from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch
from .gloo_pool import gloo_pool
from .qwen3_folders import assert_logits_equal_transformers, build_qwen3_folder

ADAMW = {"optimizer": "adamw", "lr": 1e-3}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tokenizer):
    return build_qwen3_folder(tokenizer, tmp_path_factory.mktemp("qwen3"), seed=0)


@pytest.fixture(scope="module")
def tied_qwen3_dir(tmp_path_factory, tokenizer):
    return build_qwen3_folder(tokenizer, tmp_path_factory.mktemp("qwen3_tied"), seed=1, tie=True)


def _packed_logits(model, batch):
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    return torch.cat([model(s[None]).logits[0] for s in batch.input_ids.split(lengths)])


def _hf_logprobs(model_dir, batch, dtype=torch.float64):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        logp = _packed_logits(model, batch).log_softmax(-1)
    want = logp.gather(-1, batch.targets[:, None])[:, 0]
    return torch.where(batch.loss_mask, want, 0.0).float()


@pytest.mark.parametrize("fixture", ["qwen3_dir", "tied_qwen3_dir"])
def test_qwen3_converts_exactly_and_computes_transformers_logits(request, megatron_tp1, fixture):
    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    folder = request.getfixturevalue(fixture)
    shape = ModelShape.from_model_dir(folder)
    assert (shape.architecture, shape.qk_norm, shape.qkv_bias) == ("Qwen3ForCausalLM", True, False)
    assert (shape.hidden, shape.heads, shape.head_dim) == (64, 4, 32)
    hf = load_file(folder / "model.safetensors")
    # Round trip through two tp shards; the q/k norms are per head, so replicated.
    shards = [hf_to_megatron(hf, shape, rank, 2) for rank in (0, 1)]
    q_norm = "decoder.layers.1.self_attention.q_layernorm.weight"
    assert torch.equal(shards[1][q_norm], hf["model.layers.1.self_attn.q_norm.weight"])
    full = {name: unshard(name, [s[name] for s in shards]) for name in shards[0]}
    back = megatron_to_hf(full, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name

    model = PolicyModel(shape)
    load_megatron_weights(model, hf_to_megatron(hf, shape))
    assert_logits_equal_transformers(model, folder)


def test_trainer_logprobs_and_export_equal_transformers(megatron_tp1, qwen3_dir, tmp_path):
    recipe = make_recipe(qwen3_dir, trainer=ADAMW)
    trainer = Trainer(recipe, qwen3_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [11, 17], seed=5)
    (got,) = trainer.logprobs([batch])
    torch.testing.assert_close(got, _hf_logprobs(qwen3_dir, batch), rtol=1e-4, atol=1e-4)

    trainer.train_step([batch, random_packed_batch(trainer.shape.vocab, [9, 6], seed=6)])
    exported = save_hf_folder(trainer.hf_state_dict(), qwen3_dir, tmp_path / "export")
    saved = load_file(exported / "model.safetensors")
    assert saved.keys() == load_file(qwen3_dir / "model.safetensors").keys()
    assert not torch.equal(
        saved["model.layers.0.self_attn.k_norm.weight"],
        load_file(qwen3_dir / "model.safetensors")["model.layers.0.self_attn.k_norm.weight"],
    )
    # transformers loads the export and scores the batch as the trained policy does.
    (trained,) = trainer.logprobs([batch])
    torch.testing.assert_close(trained, _hf_logprobs(exported, batch), rtol=1e-4, atol=1e-4)


def _three_adamw_steps(model_dir, parallel):
    recipe = make_recipe(model_dir, parallel=parallel, trainer=ADAMW)
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")
    vocab = trainer.shape.vocab
    batches = [random_packed_batch(vocab, [9, 14, 6], 8), random_packed_batch(vocab, [20, 4], 9)]
    return [trainer.train_step(batches) for _ in range(3)]


def _tp_job(rank, layout, model_dir):
    """Rank `rank` of tp=2 (a pool worker): both ranks train the same micro batches."""
    return _three_adamw_steps(model_dir, layout)


@pytest.mark.slow
def test_tp2_trains_like_one_process(megatron_tp1, qwen3_dir):
    """tp=2, where each rank normalises only its own heads with the replicated per-head q/k
    norms: loss and grad norm of three AdamW steps within 1e-4 of one process, on both
    ranks."""
    ranks = gloo_pool().run({"tp": 2}, _tp_job, qwen3_dir)
    one = _three_adamw_steps(qwen3_dir, {})
    for two in ranks:
        for step1, step2 in zip(one, two, strict=True):
            for name in ("loss", "grad_norm"):
                assert step2[name] == pytest.approx(step1[name], rel=1e-4), name
