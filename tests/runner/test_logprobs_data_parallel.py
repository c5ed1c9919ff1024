"""Log-probs under data parallelism: each replica computes those of the batches it trains, and
the trainer group hands them back in the batches' order (through the real trainer group, two
Ray actors), equal to one process computing them all."""

from __future__ import annotations

import pytest
import torch

from mtprun.compiler import compile_recipe
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch

SGD = {"optimizer": "sgd", "lr": 0.5, "grad_clip": 1.0}
LENGTHS = [[9, 14, 6], [20, 4], [3, 17, 8, 5], [31], [2, 11]]
REPLICA_OF = [1, 0, 0, 1, 0]  # not round-robin: a wrong return order shows


@pytest.mark.slow
def test_each_replica_computes_the_logprobs_of_its_own_batches(
    local_ray, megatron_tp1, tiny_qwen2_dir, tmp_path
):
    from mtprun.runner.trainer.group import TrainerGroup

    recipe = make_recipe(
        tiny_qwen2_dir, parallel={"dp": 2}, trainer=SGD, run_dir=str(tmp_path / "run")
    )
    plan = compile_recipe(recipe)
    one = Trainer(make_recipe(tiny_qwen2_dir, trainer=SGD), tiny_qwen2_dir, plan, "cpu")
    vocab = one.shape.vocab
    batches = [random_packed_batch(vocab, n, seed=40 + i) for i, n in enumerate(LENGTHS)]
    group = TrainerGroup.start(recipe)
    try:
        group.build(recipe, str(tiny_qwen2_dir), plan.to_json(), True)
        group.train_step(batches, REPLICA_OF)
        policy = group.logprobs(batches, replica_of=REPLICA_OF)
        reference = group.logprobs(batches, reference=True, replica_of=REPLICA_OF)
        round_robin = group.logprobs(batches)
    finally:
        group.shutdown()

    initial = one.logprobs(batches)
    one.train_step(batches)
    trained = one.logprobs(batches)
    assert not torch.allclose(trained[0], initial[0])  # the step moved the policy
    for got, want in ((policy, trained), (round_robin, trained), (reference, initial)):
        assert len(got) == len(batches)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
