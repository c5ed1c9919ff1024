"""`trainer.optimizer_state: bfloat16` in the trainer's bf16 path (megatron-core's DDP and
distributed optimizer, whose inner AdamW keeps bfloat16 moments): it trains like float32
moments, holds half their bytes, and a checkpoint resumes either exactly (each rank's own
slice). CUDA only: megatron-core's optimizer needs it (the step itself is checked on CPU by
test_adamw_kernel.py, interpreted)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("megatron-core's distributed optimizer needs CUDA", allow_module_level=True)

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer.trainer import Trainer
from mtprun.runner.trainer.triton_adamw import TritonAdamW
from mtprun.runner.trainer.worker import save_without_checksums

from .conftest import make_recipe, random_packed_batch

pytestmark = pytest.mark.gpu


def _trainer(model_dir, state: str) -> Trainer:
    recipe = make_recipe(
        model_dir,
        model={"path": str(model_dir), "dtype": "bfloat16"},
        trainer={"lr": 1e-3, "weight_decay": 0.01, "optimizer_state": state},
    )
    return Trainer(recipe, model_dir, compile_recipe(recipe), "cuda")


def _batches(vocab: int) -> list:
    lengths = [[40, 24, 64], [100, 28]]
    return [random_packed_batch(vocab, n, seed=i).to("cuda") for i, n in enumerate(lengths)]


def _moments(trainer: Trainer) -> list[torch.Tensor]:
    return [
        state[key]
        for shard in trainer.mixed._shards()
        for state in shard.optimizer.state.values()
        for key in ("exp_avg", "exp_avg_sq")
    ]


def test_bf16_moments_train_like_float32_ones_in_half_the_bytes(megatron_tp1, tiny_qwen3_dir):
    runs = {}
    for state in ("float32", "bfloat16"):
        trainer = _trainer(tiny_qwen3_dir, state)
        assert trainer.mixed is not None  # the bf16-weights path
        batches = _batches(trainer.shape.vocab)
        metrics = [trainer.train_step(batches) for _ in range(4)]
        moments = _moments(trainer)
        runs[state] = metrics, sum(t.numel() * t.element_size() for t in moments)
        if state == "bfloat16":
            inner = [shard.optimizer for shard in trainer.mixed._shards()]
            assert all(isinstance(o, TritonAdamW) for o in inner)
            assert {t.dtype for t in moments} == {torch.bfloat16}
        del trainer
        torch.cuda.empty_cache()
    (fp32, fp32_bytes), (bf16, bf16_bytes) = runs["float32"], runs["bfloat16"]
    assert bf16_bytes * 2 == fp32_bytes
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=1e-6)  # nothing stepped yet
    for a, b in zip(fp32, bf16, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
    assert bf16[-1]["loss"] < bf16[0]["loss"]


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_a_checkpoint_resumes_the_optimizer_exactly(
    megatron_tp1, tiny_qwen3_dir, moments, tmp_path
):
    trainer = _trainer(tiny_qwen3_dir, moments)
    batches = _batches(trainer.shape.vocab)
    trainer.train_step(batches)
    # Through the checkpoint's file, as TrainerWorker.save and .load write and read it.
    save_without_checksums(trainer.state_dict(), tmp_path / "trainer_rank0.pt")
    state = torch.load(tmp_path / "trainer_rank0.pt", map_location="cpu", weights_only=False)
    continued = trainer.train_step(batches)

    resumed = _trainer(tiny_qwen3_dir, moments)
    resumed.load_state_dict(state)
    assert {t.dtype for t in _moments(resumed)} == {getattr(torch, moments)}
    again = resumed.train_step(batches)
    assert again.keys() == continued.keys()
    for name, value in continued.items():  # the same kernels on the same inputs
        assert again[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
