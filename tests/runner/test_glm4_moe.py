"""GLM-4.5 (dense first layer, sigmoid router with a correction bias, grouped top-k, scaled
weights, a shared expert, q/k/v biases, q/k norms, RoPE on half of each head) through
conversion, the trainer against transformers, export, and expert parallelism against one
process."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.models.expert_shape import ExpertShape
from mtprun.runner.net import free_port
from mtprun.runner.run.export import save_hf_folder
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch
from .qwen3_folders import build_glm4_moe_folder
from .test_qwen3_moe import ADAMW, _ep_process, _hf_logprobs, _three_adamw_steps

MTP_TENSORS = {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"}


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory, tokenizer):
    return build_glm4_moe_folder(tokenizer, tmp_path_factory.mktemp("glm4_moe"), seed=0)


def test_shape_reads_glm_routing_and_leaves_the_mtp_layer_out(glm_dir):
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
    assert back.keys() == hf.keys() - MTP_TENSORS
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name

    model = PolicyModel(shape)
    load_megatron_weights(model, full)
    reference = AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, shape.vocab, (1, 24), generator=torch.Generator().manual_seed(11))
    causal = torch.triu(torch.ones(24, 24, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        got = model.eval()(ids, torch.arange(24)[None], causal)
        want = reference(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_trainer_logprobs_and_export_equal_transformers(megatron_tp1, glm_dir, tmp_path):
    recipe = make_recipe(glm_dir, trainer=ADAMW)
    trainer = Trainer(recipe, glm_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [11, 17], seed=5)
    (got,) = trainer.logprobs([batch])
    torch.testing.assert_close(got, _hf_logprobs(glm_dir, batch), rtol=1e-4, atol=1e-4)

    trainer.train_step([batch, random_packed_batch(trainer.shape.vocab, [9, 6], seed=6)])
    exported = save_hf_folder(trainer.hf_state_dict(), glm_dir, tmp_path / "export")
    saved = load_file(exported / "model.safetensors")
    assert saved.keys() == load_file(glm_dir / "model.safetensors").keys() - MTP_TENSORS
    (trained,) = trainer.logprobs([batch])
    torch.testing.assert_close(trained, _hf_logprobs(exported, batch), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_ep2_trains_like_one_process(megatron_tp1, glm_dir, tmp_path):
    """dp=2 with ep=2: routed experts split, the shared expert and the router replicated."""
    args = (free_port(), glm_dir, tmp_path / "ep2.pt")
    mp.start_processes(_ep_process, args=args, nprocs=2, start_method="spawn")
    two, two_weights = torch.load(tmp_path / "ep2.pt")
    one, one_weights = _three_adamw_steps(glm_dir, {})
    for step1, step2 in zip(one, two, strict=True):
        for name in ("loss", "grad_norm"):
            assert step2[name] == pytest.approx(step1[name], rel=1e-4), name
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, rtol=1e-3, atol=1e-4)
