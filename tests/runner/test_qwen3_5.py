"""Qwen3.5 (Gated DeltaNet and gated attention layers in `layer_types` order, zero-centred
norms, partial RoPE) through conversion both ways, the trainer against transformers on packed
rows, export (text and vision-language checkpoints), and tp=2 / pp=2 against one process."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

from mtprun.compiler import compile_recipe
from mtprun.data.batch import PackedBatch
from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.models.qwen3_5_shape import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionShape
from mtprun.models.tp_layout import unshard
from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch
from .layout_check import check_trains_like_one_process
from .qwen3_5_folders import build_qwen3_5_folder, build_qwen3_5_vl_folder

ADAMW = {"optimizer": "adamw", "lr": 1e-3}


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory, tokenizer):
    return build_qwen3_5_folder(tokenizer, tmp_path_factory.mktemp("qwen3_5"), seed=0)


@pytest.fixture(scope="module")
def qwen3_5_vl_dir(tmp_path_factory, qwen3_5_dir):
    return build_qwen3_5_vl_folder(qwen3_5_dir, tmp_path_factory.mktemp("qwen3_5_vl"), seed=1)


def test_shape_reads_the_hybrid_layers(qwen3_5_dir, qwen3_5_vl_dir):
    text = ModelShape.from_model_dir(qwen3_5_dir)
    assert text.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert text.linear_attention == LinearAttentionShape(2, 4, 64, 64, 4)
    assert (text.head_dim, text.rotary_fraction, text.qk_norm) == (32, 0.25, True)
    assert (text.output_gate, text.zero_centered_norm) == (True, True)
    # The vision-language checkpoint's text model reads as the same shape.
    vl = ModelShape.from_model_dir(qwen3_5_vl_dir)
    assert vl.architecture == "Qwen3_5ForConditionalGeneration"
    same = dataclasses.replace(vl, architecture=text.architecture, config_path=text.config_path)
    assert same == text


def test_a_layer_kind_mtprun_does_not_build_is_refused_by_name(qwen3_5_dir):
    config = json.loads((qwen3_5_dir / "config.json").read_text())
    config["layer_types"][1] = "sliding_attention"
    with pytest.raises(ValueError, match="layer_types names \\['sliding_attention'\\]"):
        ModelShape.from_hf_config(config)
    # Read for validate (whatever the architecture), the kinds are kept for its rule.
    shape = ModelShape.from_hf_config(config, supported_only=False)
    assert shape.layer_types[1] == "sliding_attention"


@pytest.mark.parametrize("fixture", ["qwen3_5_dir", "qwen3_5_vl_dir"])
def test_converts_both_ways_exactly_over_two_tp_shards(request, fixture):
    folder = request.getfixturevalue(fixture)
    shape = ModelShape.from_model_dir(folder)
    hf = load_file(folder / "model.safetensors")
    shards = [hf_to_megatron(hf, shape, rank, 2) for rank in (0, 1)]
    # Rank 1 holds GDN key head 1 with the value heads that read it (2 and 3).
    text = "model.language_model." if "vl" in fixture else "model."
    a_log = hf[text + "layers.0.linear_attn.A_log"]
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.A_log"], a_log[2:])
    qkv = hf[text + "layers.0.linear_attn.in_proj_qkv.weight"]
    rank1 = shards[1]["decoder.layers.0.self_attention.in_proj_qkv.weight"]
    # [q_1; k_1; v_2; v_3], 64 rows each, from HF's [q_0 q_1; k_0 k_1; v_0 .. v_3].
    assert torch.equal(rank1, torch.cat([qkv[64:128], qkv[192:256], qkv[384:512]]))
    full = {name: unshard(name, [s[name] for s in shards]) for name in shards[0]}
    back = megatron_to_hf(full, shape)
    # The vision tower is carried through from the source folder untouched.
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def _apart(batch: PackedBatch) -> list[PackedBatch]:
    """Each sequence of a packed batch as a batch of its own."""
    bounds = batch.cu_seqlens.tolist()
    return [
        PackedBatch(
            batch.input_ids[a:b],
            batch.targets[a:b],
            batch.loss_mask[a:b],
            batch.position_ids[a:b],
            torch.tensor([0, b - a], dtype=torch.int32),
        )
        for a, b in itertools.pairwise(bounds)
    ]


def _hf_logprobs(model, batch: PackedBatch) -> torch.Tensor:
    """Float64 transformers log-probs of the batch's targets, each sequence run on its own."""
    model = model.to(torch.float64).eval()
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    with torch.no_grad():
        logits = torch.cat([model(s[None]).logits[0] for s in batch.input_ids.split(lengths)])
    want = logits.log_softmax(-1).gather(-1, batch.targets[:, None])[:, 0]
    return torch.where(batch.loss_mask, want, 0.0).float()


def test_packed_logprobs_equal_transformers_and_export_reloads(megatron_tp1, qwen3_5_dir, tmp_path):
    """Three sequences packed in one row: log-probs equal float64 transformers (each sequence
    run alone) within 1e-4 and the trainer's own on each sequence alone within 1e-6 (the conv
    window and the delta-rule state restart at every sequence start); after a step the export
    loads in transformers and scores as the trainer does."""
    recipe = make_recipe(qwen3_5_dir, trainer=ADAMW)
    trainer = Trainer(recipe, qwen3_5_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [11, 70, 17], seed=5)
    (packed,) = trainer.logprobs([batch])
    reference = AutoModelForCausalLM.from_pretrained(qwen3_5_dir, dtype=torch.float64)
    torch.testing.assert_close(packed, _hf_logprobs(reference, batch), rtol=1e-4, atol=1e-4)
    apart = torch.cat(trainer.logprobs(_apart(batch)))
    torch.testing.assert_close(packed, apart, rtol=1e-6, atol=1e-6)

    trainer.train_step([batch, random_packed_batch(trainer.shape.vocab, [9, 6], seed=6)])
    exported = save_hf_folder(trainer.hf_state_dict(), qwen3_5_dir, tmp_path / "export")
    source = load_file(qwen3_5_dir / "model.safetensors")
    saved = load_file(exported / "model.safetensors")
    assert saved.keys() == source.keys()
    for name in ("model.layers.0.linear_attn.A_log", "model.layers.3.self_attn.q_norm.weight"):
        assert not torch.equal(saved[name], source[name]), name
    (trained,) = trainer.logprobs([batch])
    reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64)
    torch.testing.assert_close(trained, _hf_logprobs(reloaded, batch), rtol=1e-4, atol=1e-4)


def test_vision_language_checkpoint_trains_its_text_model_and_keeps_its_layout(
    megatron_tp1, qwen3_5_vl_dir, tmp_path
):
    """A Qwen3_5ForConditionalGeneration folder: the text model trains, and the export keeps
    the checkpoint's names with the vision tower untouched; transformers loads it as the
    vision-language model and scores text as the trainer does."""
    recipe = make_recipe(qwen3_5_vl_dir, trainer=ADAMW)
    trainer = Trainer(recipe, qwen3_5_vl_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [13, 19], seed=7)
    trainer.train_step([batch])
    exported = save_hf_folder(trainer.hf_state_dict(), qwen3_5_vl_dir, tmp_path / "export")
    source = load_file(qwen3_5_vl_dir / "model.safetensors")
    saved = load_file(exported / "model.safetensors")
    assert saved.keys() == source.keys()
    for name, tensor in source.items():
        if name.startswith("model.visual."):
            assert torch.equal(saved[name], tensor), name
    assert not torch.equal(saved["lm_head.weight"], source["lm_head.weight"])
    (trained,) = trainer.logprobs([batch])
    reloaded = Qwen3_5ForConditionalGeneration.from_pretrained(exported, dtype=torch.float64)
    torch.testing.assert_close(trained, _hf_logprobs(reloaded, batch), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def one_process(megatron_tp1):
    """One-process runs by model folder, the reference of every layout (`layout_check`)."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}, {"cp": 2}], ids=["tp2", "pp2", "cp2"])
def test_layouts_train_like_one_process(one_process, qwen3_5_dir, layout):
    """tp=2 (each rank one GDN key head with its two value heads, one attention group), pp=2
    (stage 0: two GDN layers; stage 1: a GDN and the attention layer, by whole-model layer
    index) and cp=2 (the GDN layers hand their conv window and state across the ranks' chunks,
    test_gated_delta_context_parallel.py) train as one process does."""
    check_trains_like_one_process(qwen3_5_dir, layout, one_process)


@pytest.fixture(scope="module")
def qwen3_5_mtp_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    return build_qwen3_5_folder(tokenizer, folder, seed=3, mtp_layers=1)


def _qwen3_5_mtp_reference(folder, ids):
    """vLLM's Qwen3.5 drafter (`Qwen3_5MultiTokenPredictor`) written with transformers
    modules: fc([pre_fc_norm_embedding(emb(next token)), pre_fc_norm_hidden(final-normed trunk
    hidden)]) (no position-0 masking) -> a gated attention layer -> norm."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.config
    tensors = load_file(folder / "model.safetensors")
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(tensors[f"mtp.{name}.weight"])
    layer_config = copy.deepcopy(config)
    layer_config.layer_types = [FULL_ATTENTION] * config.num_hidden_layers
    layer = Qwen3_5DecoderLayer(layer_config, layer_idx=0).eval()
    prefix = "mtp.layers.0."
    layer.load_state_dict({n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)})
    positions = torch.arange(ids.numel())[None]
    with torch.no_grad():
        hidden = model.model(ids[None]).last_hidden_state  # after the final norm
        emb = model.model.embed_tokens(torch.roll(ids, -1)[None])
        joint = torch.cat(
            [norms["pre_fc_norm_embedding"](emb), norms["pre_fc_norm_hidden"](hidden)], -1
        )
        x = joint @ tensors["mtp.fc.weight"].T
        rope = model.model.rotary_emb(x, positions)
        causal = torch.full((ids.numel(), ids.numel()), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=rope, attention_mask=causal, position_ids=positions)
        return norms["norm"](out)[0]


def test_mtp_layer_converts_and_matches_the_vllm_drafter_formula(megatron_tp1, qwen3_5_mtp_dir):
    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    shape = ModelShape.from_model_dir(qwen3_5_mtp_dir)
    assert shape.mtp_layers == 1
    hf = load_file(qwen3_5_mtp_dir / "model.safetensors")
    full = hf_to_megatron(hf, shape)
    back = megatron_to_hf(full, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    model = PolicyModel(shape)
    load_megatron_weights(model, full)
    model.eval()
    ids = torch.randint(0, shape.vocab, (20,), generator=torch.Generator().manual_seed(13))
    cu = torch.tensor([0, 20], dtype=torch.int32)
    with torch.no_grad():
        _, mtp = model.hidden_states(ids, torch.arange(20), cu, targets=torch.roll(ids, -1))
    want = _qwen3_5_mtp_reference(qwen3_5_mtp_dir, ids)
    # The last row reads a wrapped-around token; the head loss never uses it.
    torch.testing.assert_close(mtp[0][:-1], want[:-1], rtol=1e-5, atol=1e-5)
