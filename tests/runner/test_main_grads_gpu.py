"""The bf16 trainer's float32 main gradients against a float32 trainer's gradients of the same
step: the token embedding's (its rows added into main_grad, `embedding_grad`), the output
layer's (added by the head loss's own GEMMs, `HeadInputs.weight_main_grad`) and the linear
layers' (`apex_standins`), on a tied and an untied model and a MiMo whose MTP layer no term
trains (frozen: DDP would otherwise wait for its gradient), after steps of 2, 3 and 1 micro
batches of different shares: DDP's reduce overlaps the backward and starts when every
gradient of the last micro batch has reached its hook, the earlier ones running under no_sync
(megatron-core learns from the first step how many gradients a step hands each hook: without
no_sync the count would change with the micro batches, and the reduce start early or never).
CUDA only: the bf16 path (megatron-core's DDP and optimizer) needs it."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("megatron-core's DDP and distributed optimizer need CUDA", allow_module_level=True)

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch

pytestmark = pytest.mark.gpu

# bf16 activations and weights against float32 ones: relative to each gradient's norm.
TOLERANCE = 3e-2


def _last_step_grads(model_dir, dtype: str, steps: list[list]) -> dict[str, torch.Tensor]:
    recipe = make_recipe(
        model_dir,
        model={"path": str(model_dir), "dtype": dtype},
        trainer={"lr": 1e-6, "weight_decay": 0.0, "grad_clip": None},
    )
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cuda")
    assert (trainer.mixed is not None) == (dtype == "bfloat16")
    for batches in steps:
        trainer.train_step(batches)  # the last step's gradients stay (the next would zero them)
    grads = {}
    for name, param in trainer.model.named_parameters():
        if not param.requires_grad:  # a MiMo's MTP layer without an mtp term: frozen
            continue
        grad = param.main_grad if trainer.mixed is not None else param.grad
        grads[name] = grad.detach().float().clone()
    del trainer
    torch.cuda.empty_cache()
    return grads


@pytest.mark.parametrize("folder", ["tiny_qwen3_dir", "tiny_tied_dir", "tiny_mimo_dir"])
def test_bf16_main_grads_equal_float32_gradients(megatron_tp1, folder, request):
    model_dir = request.getfixturevalue(folder)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    lengths = [[40, 24, 64], [90], [12, 30], [70, 8], [33], [50, 50]]
    batches = [random_packed_batch(vocab, n, seed=i) for i, n in enumerate(lengths)]
    steps = [batches[:2], batches[2:5], batches[5:]]
    fp32 = _last_step_grads(model_dir, "float32", steps)
    bf16 = _last_step_grads(model_dir, "bfloat16", steps)
    assert fp32.keys() == bf16.keys()
    embedding = [n for n in fp32 if "word_embeddings" in n]
    assert embedding and any("output_layer" in n for n in fp32) != (folder == "tiny_tied_dir")
    for name, want in fp32.items():
        error = float((bf16[name] - want).norm() / want.norm().clamp(min=1e-12))
        assert error < TOLERANCE, f"{name}: relative error {error:.2e}"
