"""Mistakes a user can make with the runner's commands get a clear message and exit code 2."""

import pytest

from mtprun.cli import main
from mtprun.runner.run_dir import RunDir


@pytest.mark.parametrize("command", ["resume", "export", "ui", "eval"])
def test_a_folder_without_a_run_is_refused(command, tmp_path, capsys):
    assert main([command, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "run folder" in err


@pytest.mark.parametrize("command", ["export", "eval"])
def test_export_or_eval_before_any_checkpoint(command, tmp_path, capsys):
    RunDir(tmp_path).create().write_state({"tracking_uri": "sqlite:///x.db", "run_id": "r"})
    assert main([command, str(tmp_path)]) == 2
    assert f"no checkpoint under {tmp_path / 'checkpoints'}" in capsys.readouterr().err


def test_run_refuses_a_folder_that_holds_a_run(tmp_path, capsys):
    RunDir(tmp_path / "run").create().write_state({"tracking_uri": "sqlite:///x.db", "run_id": "r"})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel: {tiny: {architecture: qwen2, hidden: 64, heads: 2, kv_heads: 1}}\n"
        f"data: {{source: arithmetic}}\nrun_dir: {tmp_path / 'run'}\n"
    )
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"mtprun resume {tmp_path / 'run'}" in err


def test_invalid_recipe_is_reported_with_its_location(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: bad\nmodel: {tiny: {architecture: qwen2}}\ntrainer: {lr: -1}\n")
    assert main(["run", str(recipe)]) == 2
    assert f"{recipe}:3:" in capsys.readouterr().err


def test_a_missing_distill_teacher_stops_the_run_before_ray(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel: {tiny: {architecture: qwen2, hidden: 64, heads: 2, kv_heads: 1}}\n"
        "data: {source: arithmetic}\nlosses: [{kind: ce}, {kind: distill, teacher: missing}]\n"
        f"run_dir: {tmp_path / 'run'}\n"
    )
    assert main(["run", str(recipe)]) == 1
    log = (tmp_path / "run" / "log.txt").read_text()
    assert f"losses.1.teacher: {tmp_path / 'missing'} is not an HF model folder" in log
    assert "ray" not in {p.name for p in (tmp_path / "run").iterdir()}


def test_a_local_ray_instance_too_small_for_the_actors_fails_before_any_starts(tmp_path):
    # num_cpus null: Ray takes this machine's cores, known only once it starts.
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel: {tiny: {architecture: qwen2, hidden: 64, heads: 2, kv_heads: 1}}\n"
        "data: {source: arithmetic}\nparallel: {dp: 2}\nresources: {cpus_per_actor: 4096}\n"
        f"run_dir: {tmp_path / 'run'}\n"
    )
    assert main(["run", str(recipe)]) == 1
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "ClusterTooSmall: the run's actors need 8192 CPUs at once, 2 trainer ranks" in log
    assert "and the local Ray instance has" in log
    assert "trainer ready" not in log


def test_an_error_inside_a_trainer_actor_is_reported_as_itself(tmp_path):
    recipe = tmp_path / "r.yaml"  # bf16 autocast: Megatron-core runs it on CUDA only
    recipe.write_text(
        "name: r\nmodel:\n  tiny: {architecture: qwen2, hidden: 64, heads: 2, kv_heads: 1}\n"
        f"  dtype: bfloat16\ndata: {{source: arithmetic}}\nrun_dir: {tmp_path / 'run'}\n"
    )
    assert main(["run", str(recipe)]) == 1
    log = (tmp_path / "run" / "log.txt").read_text()
    error = next(line for line in log.splitlines() if "ERROR run failed" in line)
    assert error.endswith(
        "run failed at step 0: ValueError: model.dtype: bfloat16 trains under autocast, which "
        "Megatron-core supports on CUDA devices only; use model.dtype: float32 on CPU"
    ), error
