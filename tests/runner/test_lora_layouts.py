"""LoRA under every parallel layout equals one process: started from a PEFT adapter folder
(`model.lora.path`, B nonzero so every adapter matters from the first step), each layout's
shards of it are loaded (tp: B or A split like the base; pp: each stage its layers), and three
AdamW steps give the same losses, gradient norms, log-probs and gathered adapters. Expert
parallelism: attention adapters on a Qwen3-MoE policy (its experts take none) under dp2 ep2."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape
from mtprun.models.lora import init_adapters, peft_name
from mtprun.runner.net import free_port
from mtprun.runner.policy_folder import save_peft_adapter
from mtprun.runner.trainer.trainer import Trainer
from mtprun.spec.model import LoRASection
from mtprun.spec.parallel import ParallelSection

from .conftest import make_recipe, random_packed_batch
from .qwen3_folders import build_qwen3_moe_folder

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 12, "targets": ["all"]}
ATTENTION_LORA = {**LORA, "targets": ["qkv", "proj"]}  # an MoE policy's experts take none
ADAMW = {"optimizer": "adamw", "lr": 1e-2, "grad_clip": 1.0}


def _random_adapter_folder(model_dir, lora_fields, folder):
    """A PEFT adapter folder for the model in `model_dir`, A and B drawn at random."""
    shape, lora = ModelShape.from_model_dir(model_dir), LoRASection(**lora_fields)
    g = torch.Generator().manual_seed(11)
    fresh = init_adapters(shape, lora.layers, lora.rank, range(shape.layers), seed=0)
    adapters = {peft_name(n): torch.randn(t.shape, generator=g) * 0.1 for n, t in fresh.items()}
    return save_peft_adapter(adapters, lora, str(model_dir), folder)


@pytest.fixture(scope="module")
def adapter_dir(tiny_qwen2_dir, tmp_path_factory):
    return _random_adapter_folder(
        tiny_qwen2_dir, LORA, tmp_path_factory.mktemp("lora_layouts") / "adapter"
    )


def _train(model_dir, adapter_dir, parallel, batch_ids, lora_fields=LORA):
    """Three AdamW steps on micro batches `batch_ids` in an initialised process: what this
    rank reports."""
    lora = {**lora_fields, "path": str(adapter_dir)}
    recipe = make_recipe(
        model_dir, model={"path": str(model_dir), "lora": lora}, parallel=parallel, trainer=ADAMW
    )
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")
    vocab = trainer.shape.vocab
    batches = [random_packed_batch(vocab, [9, 14, 6], 8), random_packed_batch(vocab, [20, 4], 9)]
    metrics = [trainer.train_step([batches[i] for i in batch_ids]) for _ in range(3)]
    return {
        "metrics": metrics,
        "logprobs": trainer.logprobs(batches[:1]),
        "adapters": trainer.adapter_state_dict(),
    }


def _process(rank, parallel, port, model_dir, adapter_dir, out_path, lora_fields):
    from megatron.core import parallel_state

    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel

    layout = ParallelSection(**parallel)
    init_parallel(layout, rank, layout.world_size, "127.0.0.1", port)
    # Data-parallel replicas split the step's micro batches; TP, CP ranks and stages share them.
    batch_ids = [parallel_state.get_data_parallel_rank()] if layout.dp == 2 else [0, 1]
    result = _train(model_dir, adapter_dir, parallel, batch_ids, lora_fields)
    if rank == layout.world_size - 1:  # the last stage, where the losses are
        torch.save(result, out_path)
    destroy_parallel()


@pytest.mark.parametrize(
    "parallel", [{"tp": 2}, {"pp": 2}, {"cp": 2}, {"dp": 2}], ids=["tp2", "pp2", "cp2", "dp2"]
)
def test_lora_layouts_train_like_one_process(
    megatron_tp1, tiny_qwen2_dir, adapter_dir, tmp_path, parallel
):
    _assert_trains_like_one_process(tiny_qwen2_dir, adapter_dir, parallel, LORA, tmp_path)


def test_attention_lora_on_an_moe_policy_under_expert_parallelism(
    megatron_tp1, tokenizer, tmp_path
):
    model_dir = build_qwen3_moe_folder(tokenizer, tmp_path / "moe", seed=0)
    adapters = _random_adapter_folder(model_dir, ATTENTION_LORA, tmp_path / "adapter")
    parallel = {"dp": 2, "ep": 2}
    _assert_trains_like_one_process(model_dir, adapters, parallel, ATTENTION_LORA, tmp_path)


def _assert_trains_like_one_process(model_dir, adapter_dir, parallel, lora_fields, tmp_path):
    out = tmp_path / "two.pt"
    args = (parallel, free_port(), model_dir, adapter_dir, out, lora_fields)
    mp.start_processes(_process, args=args, nprocs=2, start_method="spawn")
    two = torch.load(out)
    one = _train(model_dir, adapter_dir, {}, [0, 1], lora_fields)
    assert one["metrics"][-1]["loss"] < one["metrics"][0]["loss"]
    for step1, step2 in zip(one["metrics"], two["metrics"], strict=True):
        for name in ("loss", "grad_norm", "trained_tokens"):
            assert step2[name] == pytest.approx(step1[name], rel=1e-4), name
    torch.testing.assert_close(two["logprobs"], one["logprobs"], rtol=1e-5, atol=1e-5)
    assert two["adapters"].keys() == one["adapters"].keys()
    for name, tensor in one["adapters"].items():
        torch.testing.assert_close(two["adapters"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
