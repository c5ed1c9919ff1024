"""SFT under data parallelism: a step gives every data-parallel replica its own packed row, and
the step trains like one process on all of them (through the real trainer group)."""

from __future__ import annotations

import pytest

from mtprun.compiler import compile_recipe
from mtprun.runner.run.sft_source import SftSource
from mtprun.runner.run.stages import plan_stages
from mtprun.runner.run.steps import sft_step

from .conftest import TEMPLATE, make_recipe

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


@pytest.mark.slow
def test_sft_with_two_replicas_trains_like_one_process(
    local_ray, megatron_tp1, tiny_qwen2_dir, tmp_path
):
    """Two SFT steps with parallel.dp 2 through `TrainerGroup` (two Ray actors): each step
    trains two packed rows, one per replica, and equals one process training both rows."""
    from mtprun.runner.trainer.group import TrainerGroup
    from mtprun.runner.trainer.trainer import Trainer

    recipe = _recipe(tiny_qwen2_dir, tmp_path, 2)
    (stage,) = plan_stages(recipe)
    source = SftSource(stage.recipe, tiny_qwen2_dir)
    group = TrainerGroup.start(recipe)
    try:
        group.build(stage.recipe, str(tiny_qwen2_dir), stage.plan.to_json(), False)
        results = [sft_step(group, sft=source, stage=stage, step=step).metrics for step in (1, 2)]
    finally:
        group.shutdown()

    single = _recipe(tiny_qwen2_dir, tmp_path, 1)
    trainer = Trainer(single, tiny_qwen2_dir, compile_recipe(single), "cpu")
    for step, got in zip((1, 2), results, strict=True):
        rows = source.batches(step)
        assert len(rows) == 2 and not rows[0].input_ids.equal(rows[1].input_ids)
        want = trainer.train_step(rows)
        assert got["train/tokens"] == sum(r.num_tokens for r in rows) == want["tokens"]
        assert got["train/trained_tokens"] == want["trained_tokens"]
        assert got["train/loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["train/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
