"""A trainer rank that runs out of GPU memory inside a step fails the run with where the GPU's
memory went and the settings that lower the trainer's (`fits.out_of_memory_message`; the
worker raises it in place of torch's OutOfMemoryError on CUDA)."""

from __future__ import annotations

import pytest

from mtprun.preflight.memory import GIB
from mtprun.runner.trainer.fits import TrainerOutOfMemory, out_of_memory_message

from .conftest import make_recipe

TORCH_TEXT = (
    "CUDA out of memory. Tried to allocate 732.00 MiB. GPU 0 has a total capacity of 139.80 GiB "
    "of which 719.94 MiB is free.\nIf reserved but unallocated memory is large try ..."
)


def _message(tiny_qwen3_dir, trainer: dict, held: float, free: float) -> str:
    recipe = make_recipe(tiny_qwen3_dir, rl=True, trainer=trainer)
    total = 139.8
    return out_of_memory_message(
        TORCH_TEXT,
        recipe,
        rank=1,
        doing="in a training step",
        free=int(free * GIB),
        total=int(total * GIB),
        held=int(held * GIB),
    )


def test_the_message_names_the_other_processes_memory_and_the_remedies(tiny_qwen3_dir):
    text = _message(tiny_qwen3_dir, {"micro_batch_tokens": 16384}, held=106.5, free=0.7)
    assert text.startswith("trainer rank 1 ran out of GPU memory in a training step (CUDA out of")
    assert "Tried to allocate 732.00 MiB" in text and "If reserved" not in text
    assert "its process holds 106.5 GiB, other processes 32.6 GiB, 0.7 GiB free of 139.8" in text
    assert "a smaller trainer.micro_batch_tokens (now 16384)" in text
    assert "trainer.recompute: full" in text
    assert text.endswith("or a GPU without the other processes' 32.6 GiB")


def test_full_recompute_and_an_unshared_gpu_are_not_suggested_twice(tiny_qwen3_dir):
    trainer = {"micro_batch_tokens": 4096, "recompute": "full"}
    text = _message(tiny_qwen3_dir, trainer, held=139.0, free=0.5)
    assert "recompute" not in text and "other processes'" not in text
    assert text.endswith("or more parallel.tp, parallel.pp or parallel.cp")


def test_the_error_survives_the_trip_from_a_ray_actor():
    import pickle

    err = pickle.loads(pickle.dumps(TrainerOutOfMemory("trainer rank 0 ran out")))
    assert isinstance(err, RuntimeError) and str(err) == "trainer rank 0 ran out"
    with pytest.raises(TrainerOutOfMemory, match="rank 0"):
        raise err
