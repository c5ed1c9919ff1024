"""LoRA under every parallel layout equals one process: started from a PEFT adapter folder
(`model.lora.path`, B nonzero so every adapter matters from the first step), each layout's
shards of it are loaded (tp: B or A split like the base; pp: each stage its layers), and three
AdamW steps give the same losses, gradient norms, log-probs and gathered adapters."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape
from mtprun.models.lora import init_adapters, peft_name
from mtprun.runner.net import free_port
from mtprun.runner.run.export import save_peft_adapter
from mtprun.runner.trainer.trainer import Trainer
from mtprun.spec.model import LoRASection
from mtprun.spec.parallel import ParallelSection

from .conftest import make_recipe, random_packed_batch

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 12, "targets": ["all"]}
ADAMW = {"optimizer": "adamw", "lr": 1e-2, "grad_clip": 1.0}


@pytest.fixture(scope="module")
def adapter_dir(tiny_qwen2_dir, tmp_path_factory):
    """A PEFT adapter folder for the tiny Qwen2 model, A and B drawn at random."""
    shape, lora = ModelShape.from_model_dir(tiny_qwen2_dir), LoRASection(**LORA)
    g = torch.Generator().manual_seed(11)
    fresh = init_adapters(shape, lora.layers, lora.rank, range(shape.layers), seed=0)
    adapters = {peft_name(n): torch.randn(t.shape, generator=g) * 0.1 for n, t in fresh.items()}
    folder = tmp_path_factory.mktemp("lora_layouts") / "adapter"
    return save_peft_adapter(adapters, lora, str(tiny_qwen2_dir), folder)


def _train(model_dir, adapter_dir, parallel, batch_ids):
    """Three AdamW steps on micro batches `batch_ids` in an initialised process: what this
    rank reports."""
    lora = {**LORA, "path": str(adapter_dir)}
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


def _process(rank, parallel, port, model_dir, adapter_dir, out_path):
    from megatron.core import parallel_state

    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel

    layout = ParallelSection(**parallel)
    init_parallel(layout, rank, layout.world_size, "127.0.0.1", port)
    # Data-parallel replicas split the step's micro batches; TP, CP ranks and stages share them.
    batch_ids = [parallel_state.get_data_parallel_rank()] if layout.dp == 2 else [0, 1]
    result = _train(model_dir, adapter_dir, parallel, batch_ids)
    if rank == layout.world_size - 1:  # the last stage, where the losses are
        torch.save(result, out_path)
    destroy_parallel()


@pytest.mark.parametrize(
    "parallel", [{"tp": 2}, {"pp": 2}, {"cp": 2}, {"dp": 2}], ids=["tp2", "pp2", "cp2", "dp2"]
)
def test_lora_layouts_train_like_one_process(
    megatron_tp1, tiny_qwen2_dir, adapter_dir, tmp_path, parallel
):
    out = tmp_path / "two.pt"
    args = (parallel, free_port(), tiny_qwen2_dir, adapter_dir, out)
    mp.start_processes(_process, args=args, nprocs=2, start_method="spawn")
    two = torch.load(out)
    one = _train(tiny_qwen2_dir, adapter_dir, {}, [0, 1])
    assert one["metrics"][-1]["loss"] < one["metrics"][0]["loss"]
    for step1, step2 in zip(one["metrics"], two["metrics"], strict=True):
        for name in ("loss", "grad_norm", "trained_tokens"):
            assert step2[name] == pytest.approx(step1[name], rel=1e-4), name
    torch.testing.assert_close(two["logprobs"], one["logprobs"], rtol=1e-5, atol=1e-5)
    assert two["adapters"].keys() == one["adapters"].keys()
    for name, tensor in one["adapters"].items():
        torch.testing.assert_close(two["adapters"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
