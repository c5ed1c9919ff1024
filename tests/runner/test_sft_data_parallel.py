"""SFT under data parallelism: a step gives every data-parallel replica its own packed row, and
the step trains like one process on all of them; each replica computes the log-probs of its own
batches, and rank 0 alone gathers the weights a sync moves and a checkpoint saves (through the
real trainer group)."""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape
from mtprun.runner.policy_folder import HF_FOLDER
from mtprun.runner.run.sft_source import SftSource
from mtprun.runner.run.stages import plan_stages
from mtprun.runner.run.steps import sft_step

from .conftest import TEMPLATE, make_recipe, random_packed_batch

DATA = {"source": "arithmetic", "template": TEMPLATE, "packing_length": 96, "num_samples": 64}
SGD = {"optimizer": "sgd", "lr": 0.5, "grad_clip": 1.0, "steps": 2}


def _recipe(model_dir, tmp_path, dp: int):
    return make_recipe(
        model_dir, data=DATA, parallel={"dp": dp}, trainer=SGD, run_dir=str(tmp_path / "run")
    )


def test_a_step_takes_one_row_per_replica_from_the_one_process_stream(tiny_qwen2_dir, tmp_path):
    one = SftSource(_recipe(tiny_qwen2_dir, tmp_path, 1), tiny_qwen2_dir)
    two = SftSource(_recipe(tiny_qwen2_dir, tmp_path, 2), tiny_qwen2_dir)
    three = SftSource(_recipe(tiny_qwen2_dir, tmp_path, 3), tiny_qwen2_dir)
    rows = len(one.rows)
    assert rows > 3
    # dp = 1 keeps one row a step; dp rows a step walk the same stream, epochs included.
    stream = [one.batches(s)[0] for s in range(1, 2 * rows + 2)]
    assert all(len(one.batches(s)) == 1 for s in (1, rows))
    for source, dp in ((two, 2), (three, 3)):
        got = [b for s in range(1, len(stream) // dp + 1) for b in source.batches(s)]
        assert len(source.batches(1)) == dp
        for want, row in zip(stream, got, strict=False):
            assert row.input_ids.equal(want.input_ids)


LOGPROB_LENGTHS = [[9, 14, 6], [20, 4], [3, 17, 8, 5], [31], [2, 11]]
REPLICA_OF = [1, 0, 0, 1, 0]  # not round-robin: a wrong return order shows


@pytest.mark.slow
def test_sft_with_two_replicas_trains_like_one_process(
    local_ray, megatron_tp1, tiny_qwen2_dir, tmp_path
):
    """Two SFT steps with parallel.dp 2 through `TrainerGroup` (two Ray actors): each step
    trains two packed rows, one per replica, and equals one process training both rows. Then
    log-probs: each replica computes those of its share of the batches (`replica_of`, or
    round-robin), and the group hands them back in the batches' order, the policy's and the
    frozen reference's equal to one process computing them all."""
    from mtprun.runner.trainer.group import TrainerGroup
    from mtprun.runner.trainer.trainer import Trainer

    recipe = _recipe(tiny_qwen2_dir, tmp_path, 2)
    (stage,) = plan_stages(recipe)
    source = SftSource(stage.recipe, tiny_qwen2_dir)
    group = TrainerGroup.start(recipe)
    try:
        group.build(stage.recipe, str(tiny_qwen2_dir), stage.plan.to_json(), True)
        results = [sft_step(group, sft=source, stage=stage, step=step).metrics for step in (1, 2)]
        batches = _logprob_batches(tiny_qwen2_dir)
        policy = group.logprobs(batches, replica_of=REPLICA_OF)
        round_robin = group.logprobs(batches)
        reference = group.logprobs(batches, reference=True, replica_of=REPLICA_OF)
        # Rank 0 gathers the sync payload and the saved folder alone (replica 1 skips).
        synced = ray.get(group.weights_ref())
        (tmp_path / "saved").mkdir()  # as a checkpoint's writer makes it
        group.save(str(tmp_path / "saved"))
    finally:
        group.shutdown()

    single = _recipe(tiny_qwen2_dir, tmp_path, 1)
    trainer = Trainer(single, tiny_qwen2_dir, compile_recipe(single), "cpu")
    initial = trainer.logprobs(batches)
    for step, got in zip((1, 2), results, strict=True):
        rows = source.batches(step)
        assert len(rows) == 2 and not rows[0].input_ids.equal(rows[1].input_ids)
        want = trainer.train_step(rows)
        assert got["train/tokens"] == sum(r.num_tokens for r in rows) == want["tokens"]
        assert got["train/trained_tokens"] == want["trained_tokens"]
        assert got["train/loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["train/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    trained = trainer.logprobs(batches)
    assert not torch.allclose(trained[0], initial[0])  # the steps moved the policy
    saved = load_file(tmp_path / "saved" / HF_FOLDER / "model.safetensors")
    # The grad norm's tolerance: two replicas sum the gradients in another order.
    for name, tensor in trainer.hf_state_dict().items():
        torch.testing.assert_close(synced[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    for got, want in ((policy, trained), (round_robin, trained), (reference, initial)):
        assert len(got) == len(batches)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _logprob_batches(model_dir) -> list:
    vocab = ModelShape.from_model_dir(model_dir).vocab
    return [random_packed_batch(vocab, n, seed=40 + i) for i, n in enumerate(LOGPROB_LENGTHS)]
