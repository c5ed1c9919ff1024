"""GLM-4.5 (dense first layer, sigmoid router with a correction bias, grouped top-k, scaled
weights, a shared expert, q/k/v biases, q/k norms, RoPE on half of each head) through
conversion, the trainer against transformers, export, and expert parallelism against one
process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape, build_tiny_model, hf_to_megatron, megatron_to_hf
from mtprun.models.expert_shape import ExpertShape
from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.trainer.trainer import Trainer
from mtprun.spec.model import TinyExperts, TinyModel

from .conftest import TINY, make_recipe, random_packed_batch
from .layout_check import ADAMW, check_trains_like_one_process
from .qwen3_folders import assert_logits_equal_transformers, build_glm4_moe_folder
from .test_qwen3_moe import _hf_logprobs


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory, tokenizer):
    return build_glm4_moe_folder(tokenizer, tmp_path_factory.mktemp("glm4_moe"), seed=0)


def test_shape_reads_glm_routing(glm_dir):
    shape = ModelShape.from_model_dir(glm_dir)
    assert (shape.architecture, shape.qkv_bias, shape.qk_norm) == ("Glm4MoeForCausalLM", True, True)
    assert (shape.rotary_fraction, shape.mtp_layers, shape.rms_norm_eps) == (0.5, 0, 1e-5)
    assert shape.experts == ExpertShape(
        count=4, top_k=2, intermediate=32, score="sigmoid", score_bias=True, groups=2,
        group_top_k=1, scaling=2.5, shared_intermediate=32, dense_layers=(0,),
    )  # fmt: skip


def test_converts_both_ways_exactly_and_computes_transformers_logits(megatron_tp1, glm_dir):
    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    shape = ModelShape.from_model_dir(glm_dir)
    hf = load_file(glm_dir / "model.safetensors")
    full = hf_to_megatron(hf, shape)
    assert torch.equal(
        full["decoder.layers.1.mlp.router.expert_bias"],
        hf["model.layers.1.mlp.gate.e_score_correction_bias"],
    )
    back = megatron_to_hf(full, shape)
    assert back.keys() == hf.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name

    model = PolicyModel(shape)
    load_megatron_weights(model, full)
    assert_logits_equal_transformers(model, glm_dir)


def test_trainer_logprobs_and_export_equal_transformers(megatron_tp1, glm_dir, tmp_path):
    recipe = make_recipe(glm_dir, trainer=ADAMW)
    trainer = Trainer(recipe, glm_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [11, 17], seed=5)
    (got,) = trainer.logprobs([batch])
    torch.testing.assert_close(got, _hf_logprobs(glm_dir, batch), rtol=1e-4, atol=1e-4)

    trainer.train_step([batch, random_packed_batch(trainer.shape.vocab, [9, 6], seed=6)])
    exported = save_hf_folder(trainer.hf_state_dict(), glm_dir, tmp_path / "export")
    saved = load_file(exported / "model.safetensors")
    assert saved.keys() == load_file(glm_dir / "model.safetensors").keys()
    (trained,) = trainer.logprobs([batch])
    torch.testing.assert_close(trained, _hf_logprobs(exported, batch), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def one_process(megatron_tp1):
    """One-process runs by model folder, the reference of every layout (`layout_check`)."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"dp": 2, "ep": 2}, {"tp": 2}], ids=["dp2ep2", "tp2"])
def test_layouts_train_like_one_process(one_process, glm_dir, layout):
    """Routed experts split over ep (the shared expert and the router replicated); tp=2 (the
    shared expert split over tp like a dense MLP, the routed experts whole, each rank routing
    half of the tokens). pp with experts: the Qwen3-MoE case."""
    check_trains_like_one_process(glm_dir, layout, one_process)


@pytest.fixture(scope="module")
def glm_mtp_dir(tmp_path_factory, tokenizer):
    spec = TinyModel(
        architecture="glm4_moe", mtp_layers=1, experts=TinyExperts(intermediate=32), **TINY
    )
    folder = build_tiny_model(spec, tokenizer, tmp_path_factory.mktemp("glm_mtp"), seed=2)
    # A final norm other than ones: the MTP layer must read the trunk's normed hidden state
    # (an RMSNorm of weight ones would not tell it from the pre-norm one).
    weights = load_file(folder / "model.safetensors")
    norm = weights["model.norm.weight"]
    weights["model.norm.weight"] = 1 + 0.5 * torch.randn(
        norm.shape, generator=torch.Generator().manual_seed(5)
    )
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _glm_mtp_reference(folder, ids):
    """vLLM's GLM-4.5 MTP layer (`Glm4MoeMultiTokenPredictorLayer`), written with
    transformers modules: the folder loaded with one more decoder layer is the MTP layer's."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm

    config = AutoConfig.from_pretrained(folder)
    layers = config.num_hidden_layers
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, num_hidden_layers=layers + 1, attn_implementation="sdpa"
    ).eval()
    mtp = load_file(folder / "model.safetensors")
    prefix = f"model.layers.{layers}."
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[f"{prefix}{name}.weight"])
    captured = {}
    layer = hf.model.layers[layers]
    layer.register_forward_pre_hook(
        lambda _m, args, kwargs: captured.update(h=args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True,
    )
    positions = torch.arange(ids.numel())[None]
    with torch.no_grad():
        hf(ids[None])
        emb = hf.model.embed_tokens(torch.roll(ids, -1)[None])
        emb = emb.masked_fill((positions == 0)[..., None], 0.0)
        # vLLM's drafter gets the trunk's output: its final-normed hidden state.
        trunk = hf.model.norm(captured["h"])
        joint = torch.cat([norms["enorm"](emb), norms["hnorm"](trunk)], -1)
        x = joint @ mtp[prefix + "eh_proj.weight"].T
        rope = hf.model.rotary_emb(x, positions)
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return norms["shared_head.norm"](out)[0]


def test_glm_mtp_layer_converts_and_matches_vllm_formula(megatron_tp1, glm_mtp_dir):
    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    shape = ModelShape.from_model_dir(glm_mtp_dir)
    assert shape.mtp_layers == 1
    hf = load_file(glm_mtp_dir / "model.safetensors")
    full = hf_to_megatron(hf, shape)
    assert "mtp_layers.0.decoder_layer.mlp.experts.weight1" in full
    back = megatron_to_hf(full, shape)
    assert back.keys() == hf.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name
    # A checkpoint's copies of the trunk's output layer and embedding in the MTP layer (the
    # drafter reads the trunk's) are left out; any other stray tensor is an error.
    mtp_prefix = f"model.layers.{shape.layers}."
    copies = {mtp_prefix + "shared_head.head.weight": hf["lm_head.weight"]}
    assert hf_to_megatron({**hf, **copies}, shape).keys() == full.keys()
    with pytest.raises(ValueError, match="does not use"):
        hf_to_megatron({**hf, mtp_prefix + "stray.weight": hf["lm_head.weight"]}, shape)

    model = PolicyModel(shape)
    load_megatron_weights(model, full)
    model.eval()
    ids = torch.randint(0, shape.vocab, (20,), generator=torch.Generator().manual_seed(13))
    cu = torch.tensor([0, 20], dtype=torch.int32)
    with torch.no_grad():
        _, mtp = model.hidden_states(ids, torch.arange(20), cu, targets=torch.roll(ids, -1))
    want = _glm_mtp_reference(glm_mtp_dir, ids)
    # The last row reads a wrapped-around token; the head loss never uses it.
    torch.testing.assert_close(mtp[0][:-1], want[:-1], rtol=1e-5, atol=1e-5)


def test_glm_mtp_layer_trains_on_the_mtp_term_alone(megatron_tp1, glm_mtp_dir):
    """The mtp term trains the MTP layer (its experts included) and leaves the trunk's
    gradients as the ce term alone makes them."""
    grads = {}
    for losses in ([{"kind": "ce"}], [{"kind": "ce"}, {"kind": "mtp", "weight": 0.5}]):
        recipe = make_recipe(glm_mtp_dir, trainer={**ADAMW, "grad_clip": None}, losses=losses)
        trainer = Trainer(recipe, glm_mtp_dir, compile_recipe(recipe), "cpu")
        batch = random_packed_batch(trainer.shape.vocab, [17, 12], seed=4)
        metrics = trainer.train_step([batch])
        grads[len(losses)] = {
            n: None if p.grad is None else p.grad.clone()
            for n, p in trainer.model.named_parameters()
        }
    assert metrics["mtp"] > 0
    for name, grad in grads[1].items():
        if name.startswith("mtp_layers."):
            continue
        torch.testing.assert_close(grads[2][name], grad, rtol=1e-6, atol=1e-8, msg=name)
    experts = grads[2]["mtp_layers.0.decoder_layer.mlp.experts.weight1"]
    assert experts is not None and experts.abs().sum() > 0
