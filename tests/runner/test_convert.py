"""HF <-> Megatron-core conversion: exact round trips over TP layouts, and the converted
Megatron model computes what transformers computes from the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

from mtprun.models import ModelShape, build_tiny_model, convert, hf_to_megatron, megatron_to_hf
from mtprun.models.decoder import fuse_qkv, split_qkv
from mtprun.models.pp_layout import PipelineStage, global_tensors, stage_reads, stage_tensors
from mtprun.models.tp_layout import unshard
from mtprun.spec.model import TinyExperts, TinyModel

from .conftest import TINY
from .qwen3_5_folders import build_qwen3_5_folder


def _shape(**change) -> ModelShape:
    base = dict(
        architecture="Qwen2ForCausalLM", hidden=64, layers=1, heads=8, kv_heads=2, head_dim=8,
        intermediate=32, vocab=16, tie_embeddings=False, qkv_bias=True, mtp_layers=0,
        rms_norm_eps=1e-6, rope_theta=1e4, max_seq_len=64,
    )  # fmt: skip
    return ModelShape(**{**base, **change})


def test_fused_qkv_is_laid_out_per_query_group():
    shape = _shape()
    q, k, v = torch.randn(64, 5), torch.randn(16, 5), torch.randn(16, 5)
    fused = fuse_qkv(q, k, v, shape)
    rows_per_group = (4 + 2) * 8  # 4 query heads, one key and one value head of size 8
    for g in range(2):
        block = fused[g * rows_per_group : (g + 1) * rows_per_group]
        torch.testing.assert_close(block[:32], q[g * 32 : (g + 1) * 32])
        torch.testing.assert_close(block[32:40], k[g * 8 : (g + 1) * 8])
        torch.testing.assert_close(block[40:], v[g * 8 : (g + 1) * 8])
    for got, want in zip(split_qkv(fused, shape), (q, k, v), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "fixture", ["tiny_qwen2_dir", "tiny_mimo_dir", "tiny_tied_dir", "llama_dir"]
)
def test_round_trip_through_tp_shards_is_exact(request, fixture, tp):
    folder = request.getfixturevalue(fixture)
    shape = ModelShape.from_model_dir(folder)
    hf = load_file(folder / "model.safetensors")
    shards = [hf_to_megatron(hf, shape, rank, tp) for rank in range(tp)]
    full = {name: unshard(name, [s[name] for s in shards]) for name in shards[0]}
    back = megatron_to_hf(full, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("fixture", ["tiny_mimo_dir", "tiny_tied_dir"])
def test_round_trip_through_pipeline_stages_is_exact(request, fixture):
    folder = request.getfixturevalue(fixture)
    shape = ModelShape.from_model_dir(folder)
    full = hf_to_megatron(load_file(folder / "model.safetensors"), shape)
    first, last = (stage_tensors(full, shape, PipelineStage(r, 2, shape.layers)) for r in (0, 1))
    # Stage-local layer numbers; the embedding first, the final norm and the heads last.
    assert {n.split(".")[2] for n in [*first, *last] if n.startswith("decoder.layers.")} == {"0"}
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last
    assert "output_layer.weight" in last  # a copy of the embedding when tied
    assert any(n.startswith("mtp_layers.") for n in last) == (shape.mtp_layers > 0)
    # The MTP layers' next-token lookups need the embedding on the last stage too.
    assert ("embedding.word_embeddings.weight" in last) == (shape.mtp_layers > 0)
    first, last = (
        global_tensors(local, shape, PipelineStage(rank, 2, shape.layers))
        for rank, local in enumerate((first, last))
    )
    assert not first.keys() & last.keys()  # each tensor exported by one stage, copies by none
    merged = {**first, **last}
    assert merged.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name


def _mtp_folder(request, tmp_path, family: str):
    """A folder with MTP layers of each naming: MiMo's `model.mtp_layers.`, GLM-4.5's layers
    after the trunk's, Qwen3.5's `mtp.` (beside `model.language_model.`-less text layers)."""
    tokenizer = request.getfixturevalue("tokenizer")
    if family == "glm4_moe":
        spec = TinyModel(
            architecture="glm4_moe", mtp_layers=1, experts=TinyExperts(intermediate=32), **TINY
        )
        return build_tiny_model(spec, tokenizer, tmp_path, seed=0)
    if family == "qwen3_5":
        return build_qwen3_5_folder(tokenizer, tmp_path, seed=0, mtp_layers=1)
    return request.getfixturevalue(family)


@pytest.mark.parametrize(
    "family", ["tiny_mimo_dir", "tiny_tied_dir", "tiny_tied_mimo_dir", "glm4_moe", "qwen3_5"]
)
def test_a_pipeline_stage_converts_from_its_own_layers_alone(request, tmp_path, family):
    folder = _mtp_folder(request, tmp_path, family)
    shape = ModelShape.from_model_dir(folder)
    hf = load_file(folder / "model.safetensors")
    full = hf_to_megatron(hf, shape)
    for rank in (0, 1):
        stage = PipelineStage(rank, 2, shape.layers)
        # The tensors this stage passes over hold no data here: converting must not need them.
        own = {n: t if stage_reads(n, shape, stage) else t.to("meta") for n, t in hf.items()}
        assert len(own) > sum(not t.is_meta for t in own.values())  # it passes over some
        local = hf_to_megatron(own, shape, stage=stage)
        expected = stage_tensors(full, shape, stage)
        assert local.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(local[name], tensor), name
    # A stage tensor converted without data is refused, not loaded empty.
    first = PipelineStage(0, 2, shape.layers)
    layer0 = next(n for n in hf if ".layers.0." in n and not n.startswith("mtp."))
    with pytest.raises(RuntimeError, match="did not read"):
        hf_to_megatron({**hf, layer0: hf[layer0].to("meta")}, shape, stage=first)


@pytest.mark.parametrize("family", ["tiny_qwen2_dir", "tiny_tied_mimo_dir", "glm4_moe", "qwen3_5"])
def test_tp_shards_converted_a_layer_at_a_time_equal_one_pass(
    request, tmp_path, monkeypatch, family
):
    folder = _mtp_folder(request, tmp_path, family)
    shape = ModelShape.from_model_dir(folder)
    hf = load_file(folder / "model.safetensors")
    assert shape.layers < convert.LAYERS_PER_PASS  # the default converts these in one pass
    stages = [None, *(PipelineStage(r, 2, shape.layers) for r in (0, 1))]
    one_pass = [hf_to_megatron(hf, shape, 1, 2, stage=stage) for stage in stages]
    monkeypatch.setattr(convert, "LAYERS_PER_PASS", 1)
    for stage, expected in zip(stages, one_pass, strict=True):
        shards = hf_to_megatron(hf, shape, 1, 2, stage=stage)
        assert shards.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(shards[name], tensor), name


def test_pipeline_stages_refuse_a_split_that_does_not_fit():
    with pytest.raises(ValueError, match="pp=2 does not divide the model's 3 decoder layers"):
        PipelineStage(0, 2, 3)
    with pytest.raises(ValueError, match=r"stage 2 is outside 0\.\.1"):
        PipelineStage(2, 2, 2)
    with pytest.raises(ValueError, match=r"no pipeline stage is known to hold 'rotary\.inv_freq'"):
        stage_tensors({"rotary.inv_freq": torch.ones(1)}, _shape(), PipelineStage(0, 1, 1))


def test_tp_shards_split_the_vocab_and_the_glu_halves(tiny_qwen2_dir):
    shape = ModelShape.from_model_dir(tiny_qwen2_dir)
    hf = load_file(tiny_qwen2_dir / "model.safetensors")
    rank1 = hf_to_megatron(hf, shape, tp_rank=1, tp_size=2)
    vocab, inter = shape.vocab, shape.intermediate
    assert torch.equal(rank1["output_layer.weight"], hf["lm_head.weight"][vocab // 2 :])
    fc1 = rank1["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: inter // 2], hf["model.layers.0.mlp.gate_proj.weight"][inter // 2 :])
    assert torch.equal(fc1[inter // 2 :], hf["model.layers.0.mlp.up_proj.weight"][inter // 2 :])
    proj = rank1["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"][:, shape.hidden // 2 :])


def test_mismatched_checkpoints_are_refused(tiny_qwen2_dir, tiny_mimo_dir):
    shape = ModelShape.from_model_dir(tiny_qwen2_dir)
    hf = load_file(tiny_qwen2_dir / "model.safetensors")
    missing = {k: v for k, v in hf.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_megatron(missing, shape, source="ckpt")
    with pytest.raises(ValueError, match=r"does not use.*mtp_layers"):
        hf_to_megatron(load_file(tiny_mimo_dir / "model.safetensors"), shape)
    with pytest.raises(ValueError, match=r"parallel\.tp=3 does not divide"):
        hf_to_megatron(hf, shape, tp_rank=0, tp_size=3)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random-init Llama (no q/k/v biases) saved by transformers itself."""
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(5)
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _megatron_model(folder):
    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    shape = ModelShape.from_model_dir(folder)
    model = PolicyModel(shape)
    load_megatron_weights(model, hf_to_megatron(load_file(folder / "model.safetensors"), shape))
    return model.eval()


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_tied_dir", "llama_dir"])
def test_megatron_logits_equal_transformers_logits(request, megatron_tp1, fixture):
    folder = request.getfixturevalue(fixture)
    model = _megatron_model(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, model.shape.vocab, (1, 24), generator=g)
    causal = torch.triu(torch.ones(24, 24, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        got = model(ids, torch.arange(24)[None], causal)
        want = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_forward_equals_transformers_per_sequence(megatron_tp1, tiny_qwen2_dir):
    model = _megatron_model(tiny_qwen2_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    lengths = [7, 12, 5]
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, model.shape.vocab, (sum(lengths),), generator=g)
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        hidden, mtp = model.hidden_states(ids, positions, cu)
        got = hidden @ model.output_weight().T
        want = torch.cat([hf(part[None]).logits[0] for part in ids.split(lengths)])
    assert mtp == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _mimo_reference(folder, ids):
    """vLLM's MiMo MTP layer, written with transformers modules from the HF tensors."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tensors = load_file(folder / "model.safetensors")
    prefix = "model.mtp_layers.0."
    mtp = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    config = hf.config
    layer = Qwen2DecoderLayer(config, layer_idx=0).eval()
    layer_names = set(layer.state_dict())
    layer.load_state_dict({k: v for k, v in mtp.items() if k in layer_names})
    norms = {}
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        norms[name] = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[f"{name}.weight"])

    captured = {}
    hf.model.norm.register_forward_hook(lambda _m, inp, _o: captured.update(pre_norm=inp[0]))
    positions = torch.arange(ids.numel())[None]
    with torch.no_grad():
        hf(ids[None])
        next_tokens = torch.roll(ids, -1)[None]
        emb = hf.model.embed_tokens(next_tokens).masked_fill((positions == 0)[..., None], 0.0)
        joint = torch.cat(
            [norms["hidden_layernorm"](captured["pre_norm"]), norms["token_layernorm"](emb)], -1
        )
        x = joint @ mtp["input_proj.weight"].T
        rope = hf.model.rotary_emb(x, positions)
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return norms["final_layernorm"](out)[0]


def test_mimo_mtp_layer_matches_vllm_formula(megatron_tp1, tiny_mimo_dir):
    model = _megatron_model(tiny_mimo_dir)
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, model.shape.vocab, (20,), generator=g)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    with torch.no_grad():
        _, mtp = model.hidden_states(ids, torch.arange(20), cu, targets=torch.roll(ids, -1))
    want = _mimo_reference(tiny_mimo_dir, ids)
    # The last row reads a wrapped-around token; the head loss never uses it.
    torch.testing.assert_close(mtp[0][:-1], want[:-1], rtol=1e-5, atol=1e-5)
