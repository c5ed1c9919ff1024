"""`resources.placement`: colocated layouts that cannot work are refused at the value that
breaks them (with what to write instead), the weight transfer follows the placement, and the
memory of each colocated phase is held against resources.gpu_memory_gib."""

from __future__ import annotations

import dataclasses

import pytest

from mtprun.preflight import load_recipe
from mtprun.preflight.colocation import CONTEXT_BYTES, colocated_memory, sync_part_params
from mtprun.preflight.memory import parameters, recipe_trainer_memory
from mtprun.preflight.model_shape import recipe_shape
from mtprun.spec.actors import ActorDemand
from mtprun.spec.resources import weight_transfer_method

# An RL recipe colocated on one GPU (11 lines before `resources:`'s keys).
COLOCATED = """\
name: t
model:
  tiny: {hidden: 1024, layers: 8, heads: 8, kv_heads: 8, intermediate: 4096, vocab: 32000}
  dtype: bfloat16
task: {name: arithmetic, reward: arithmetic, template: char}
losses: [{kind: grpo}]
rollout:
  max_tokens: 16
trainer:
  micro_batch_tokens: 4096
resources:
  num_gpus: 1
  gpus_per_actor: 1
  placement: colocate
"""


def test_a_colocated_recipe_validates_and_moves_weights_through_cuda_ipc(
    write_recipe, located
) -> None:
    path = write_recipe(COLOCATED)
    assert located(path) == []
    recipe = load_recipe(path)
    assert weight_transfer_method(recipe) == "cuda_ipc"
    demand = ActorDemand.of(recipe)
    assert (demand.need("GPU"), demand.need("CPU")) == (1, 2)  # the engine on the rank's GPU
    lora = load_recipe(path, ["model.lora={rank: 8}"])
    assert weight_transfer_method(lora) == "object_store"  # adapters alone: a few MiB
    split = load_recipe(path, ["resources.placement=split", "resources.num_gpus=2"])
    assert weight_transfer_method(split) == "collective"
    assert ActorDemand.of(split).need("GPU") == 2


@pytest.mark.parametrize(
    ("old", "new", "where", "message"),
    [
        ("gpus_per_actor: 1", "gpus_per_actor: 0.5", "13:19", "set resources.gpus_per_actor: 1"),
        ("max_tokens: 16", "num_engines: 2", "8:16", "set rollout.num_engines: 1"),
        ("max_tokens: 16", "max_staleness: 1", "8:18", "set rollout.max_staleness: 0"),
        ("max_tokens: 16", "weight_transfer: collective", "8:20", "NCCL refuses two ranks"),
    ],
)
def test_a_colocated_layout_that_cannot_work_is_refused_at_its_value(
    write_recipe, located, old, new, where, message
) -> None:
    path = write_recipe(COLOCATED.replace(old, new))
    (problem,) = located(path)
    assert problem.startswith(f"{path}:{where}: "), problem
    assert message in problem


def test_cuda_ipc_needs_colocation(write_recipe, located) -> None:
    text = COLOCATED.replace("colocate", "split").replace("num_gpus: 1", "num_gpus: 2")
    path = write_recipe(text.replace("max_tokens: 16", "weight_transfer: cuda_ipc"))
    (problem,) = located(path)
    assert problem.startswith(f"{path}:8:20: cuda_ipc hands each engine its trainer rank's GPU")
    assert "set resources.placement: colocate" in problem


def test_each_colocated_phase_is_counted_and_the_largest_held_against_the_gpu(
    write_recipe, located
) -> None:
    path = write_recipe(COLOCATED)
    memory = colocated_memory(load_recipe(path))
    assert not isinstance(memory, str)
    trainer = recipe_trainer_memory(load_recipe(path))
    engine = 2 * parameters(recipe_shape(load_recipe(path)))
    contexts = 2 * CONTEXT_BYTES
    assert memory.generation == trainer.weights + engine + 3 * 1024**3 + contexts
    assert memory.training == trainer.total + contexts
    part = 2 * sync_part_params(recipe_shape(load_recipe(path)), pp=1)
    # Its weights and the engine's, a part gathered, packed and copied by the engine.
    assert memory.sync == trainer.weights + engine + 3 * part + contexts
    phase, need = memory.largest()
    assert phase == "training"
    too_small = f"resources.gpu_memory_gib={need / 1024**3 - 0.5:.1f}"
    (problem,) = located(path, [too_small])
    expected = f"colocated, the training phase needs an estimated {need / 1024**3:.1f} GiB"
    assert expected in problem
    assert "use resources.placement: split" in problem
    fits = f"resources.gpu_memory_gib={need / 1024**3 + 0.5:.1f}"
    assert located(path, [fits]) == []


def test_a_syncs_largest_part_is_the_first_two_layers_with_the_rest_or_the_whole_under_pp(
    write_recipe,
) -> None:
    shape = recipe_shape(load_recipe(write_recipe(COLOCATED)))
    assert not isinstance(shape, str)
    layer = parameters(shape) - parameters(dataclasses.replace(shape, layers=7))
    assert layer > 0
    # Embedding, output layer and final norm beside layers 0 and 1: all but six layers.
    assert sync_part_params(shape, pp=1) == parameters(shape) - 6 * layer
    assert sync_part_params(shape, pp=2) == parameters(shape)


def test_engine_memory_share_is_checked(write_recipe, located) -> None:
    path = write_recipe(COLOCATED)
    (problem,) = located(path, ["rollout.gpu_memory_utilization=1.5"])
    assert "gpu_memory_utilization" in problem and "less than 1" in problem


def test_plan_shows_the_placement_and_each_colocated_phase(write_recipe, capsys) -> None:
    import json

    from mtprun.cli import main

    path = write_recipe(COLOCATED)
    assert main(["plan", str(path), "--json"]) == 0
    loop = json.loads(capsys.readouterr().out)["rollout_loop"]
    memory = colocated_memory(load_recipe(path))
    assert not isinstance(memory, str)
    assert (loop["placement"], loop["weight_transfer"]) == ("colocate", "cuda_ipc")
    assert loop["colocated_memory"] == memory.phases()
    assert main(["plan", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "colocate: engine i shares trainer rank i's GPU" in out
    assert "CUDA IPC: each trainer rank packs the weights" in out
