"""The RL loop on GPUs: vLLM CUDA engines (CUDA graphs on), colocated beside the trainer and
apart from it. CUDA only (marked gpu): run on the GPU machine, recorded in bench/RESULTS.md.

- The trainer's optimizer state and gradients go to the host and come back bit for bit.
- Colocated end to end (`mtprun run`, one GPU): the engine sleeps while the trainer trains,
  weights reach it through CUDA IPC, and after the sync its sampled log-probs equal the
  trainer's recomputed ones to bf16 tolerance (`train/logprob_mismatch`); every part of the
  step is logged with the tokens per second per GPU.
- A colocated engine's greedy generation is the same before and after a sleep and a sync of
  the same weights, and a SIGKILLed engine is restarted beside its rank and re-synced.
- Split (two GPUs, skipped with one): NCCL broadcast into the engine, asynchronous rollouts.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("vLLM CUDA engines and colocation need a GPU", allow_module_level=True)

from mlflow import MlflowClient

from mtprun.spec import Recipe

from .cli_run import ENV, MTPRUN
from .conftest import TEMPLATE, make_recipe, random_packed_batch
from .gpu_folders import gpu_folder

pytestmark = pytest.mark.gpu

# bf16 engine against bf16 trainer (different kernels): mean |log-prob difference|.
LOGPROB_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def gpu_qwen3_dir(tmp_path_factory, tokenizer) -> Path:
    return gpu_folder(tmp_path_factory.mktemp("qwen3gpu"), tokenizer, "qwen3")


# The families of the colocated end-to-end runs: (architecture, model fields, recipe changes).
FAMILIES = {
    "dense": ("qwen3", {}, {}),
    "moe-router-replay": ("qwen3_moe", {}, {"trainer": {"router_replay": True}}),
    "lora": ("qwen3", {}, {"model": {"lora": {"rank": 8}}}),
    "mtp-drafter": ("mimo", {"mtp_layers": 1}, {"rollout": {"speculative": {"method": "mtp"}}}),
}


def _rl_recipe(model_dir: Path, placement: str, **rollout) -> dict:
    return {
        "name": f"gpu-{placement}",
        "model": {"path": str(model_dir), "dtype": "bfloat16"},
        "task": {
            "name": "arithmetic",
            "reward": "arithmetic",
            "template": TEMPLATE,
            "samples_per_prompt": 4,
            "prompts_per_step": 8,
        },
        "losses": [{"kind": "grpo", "kl_coef": 0.0}],
        "rollout": {"max_tokens": 32, "recompute_logprobs": True, **rollout},
        "trainer": {"lr": 1e-3, "steps": 3, "micro_batch_tokens": 2048},
        "resources": {
            "num_gpus": 1 if placement == "colocate" else 2,
            "gpus_per_actor": 1,
            "placement": placement,
        },
    }


def _run(tmp_path: Path, recipe: dict) -> dict[str, dict[int, float]]:
    import subprocess

    recipe["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    done = subprocess.run(
        [*MTPRUN, "run", str(path)], env=ENV, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id)
    return {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in run.data.metrics
    }


def _assert_rl_steps(metrics: dict[str, dict[int, float]], parts: tuple[str, ...]) -> None:
    assert sorted(metrics["time/step_s"]) == [1, 2, 3]
    for step in (2, 3):  # after a weight sync: the engine holds the trainer's weights
        assert metrics["train/logprob_mismatch"][step] < LOGPROB_TOLERANCE
    for key in ("time/idle_s", "throughput/tokens_per_s_per_gpu", *parts):
        assert all(v >= 0 for v in metrics[key].values()), key
    assert all(v > 0 for v in metrics["throughput/tokens_per_s_per_gpu"].values())


def test_offload_returns_the_optimizer_state_and_frees_the_gpu(
    gpu_qwen3_dir, tokenizer, megatron_tp1
):
    from mtprun.compiler import compile_recipe
    from mtprun.runner.trainer.offload import trainer_offload
    from mtprun.runner.trainer.trainer import Trainer

    recipe = make_recipe(gpu_qwen3_dir, model={"path": str(gpu_qwen3_dir), "dtype": "bfloat16"})
    trainer = Trainer(recipe, gpu_qwen3_dir, compile_recipe(recipe), "cuda")
    batch = random_packed_batch(len(tokenizer), [40, 24], seed=1)
    trainer.train_step([batch])  # AdamW's moments exist after a step
    state = {k: v.clone() for k, v in _optimizer_tensors(trainer).items()}
    before = torch.cuda.memory_allocated()
    offload = trainer_offload(trainer)
    offload.to_host()
    assert torch.cuda.memory_allocated() <= before - offload.nbytes + (1 << 20)
    assert offload.nbytes >= sum(t.numel() * t.element_size() for t in state.values())
    offload.to_device()
    for name, tensor in _optimizer_tensors(trainer).items():
        assert torch.equal(tensor, state[name]), name
    # The next offload takes over the pinned buffers, and the trainer steps on.
    again = trainer_offload(trainer, offload)
    assert again._host is offload._host
    trainer.train_step([batch])


def _optimizer_tensors(trainer) -> dict[str, torch.Tensor]:
    from mtprun.runner.trainer.offload import _torch_optimizers

    found = {}
    for i, optimizer in enumerate(_torch_optimizers(trainer)):
        for j, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    found[f"{i}.{j}.{key}"] = value
    return found


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_colocated_run_trains_with_cuda_ipc_syncs(family, tokenizer, tmp_path):
    architecture, fields, changes = FAMILIES[family]
    folder = gpu_folder(tmp_path / "model", tokenizer, architecture, **fields)
    recipe = _rl_recipe(folder, "colocate")
    for section, values in changes.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    metrics = _run(tmp_path, recipe)
    parts = ("time/engine_sleep_s", "time/onload_s", "time/offload_s", "time/sync_s")
    _assert_rl_steps(metrics, parts)
    assert all(v > 0 for v in metrics["memory/offloaded_gib"].values())
    if family == "mtp-drafter":
        assert sorted(metrics["rollout/spec_accept_rate"]) == [1, 2, 3]


@pytest.mark.slow
def test_colocated_engine_sleeps_wakes_and_survives_a_kill(gpu_qwen3_dir, tokenizer, tmp_path):
    import ray

    from mtprun.compiler import compile_recipe
    from mtprun.runner.placement import Placement
    from mtprun.runner.rollout.pool import RolloutPool
    from mtprun.runner.run.weight_sync import WeightSync
    from mtprun.runner.trainer.group import TrainerGroup

    recipe = Recipe.model_validate(_rl_recipe(gpu_qwen3_dir, "colocate", temperature=0.0))
    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    placement = Placement(recipe)
    trainer = TrainerGroup.start(recipe, placement)
    pool = None
    try:
        trainer.build(recipe, str(gpu_qwen3_dir), compile_recipe(recipe).to_json(), False)
        trainer.offload()
        pool = RolloutPool.launch(recipe, gpu_qwen3_dir, tmp_path / "engines", placement).ready()
        sync = WeightSync("cuda_ipc", lambda: trainer, pool)
        prompts = [tokenizer("12+34=").input_ids, tokenizer("7*8=").input_ids]
        sync.push()  # the trainer's weights (the folder's, through bf16 megatron)
        greedy = pool.generate(prompts, n=1)
        pool.sleep()
        trainer.onload()
        trainer.offload()
        sync.push()  # wakes the engine with the same weights
        _assert_same_samples(pool.generate(prompts, n=1), greedy)
        os.kill(pool.pids[0], signal.SIGKILL)
        after = pool.generate(prompts, n=1)  # restarted beside rank 0, re-synced by CUDA IPC
        assert pool.restarts == 1
        _assert_same_samples(after, greedy)
    finally:
        if pool is not None:
            pool.shutdown()
        trainer.shutdown()
        placement.remove()
        ray.shutdown()


def _assert_same_samples(left: list, right: list) -> None:
    for a, b in zip(left, right, strict=True):
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
        for x, y in zip(a, b, strict=True):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="split placement needs two GPUs")
def test_split_run_with_nccl_and_async_rollouts(gpu_qwen3_dir, tmp_path):
    recipe = _rl_recipe(gpu_qwen3_dir, "split", max_staleness=1)
    recipe["trainer"]["lr"] = 1e-6  # an episode one step stale: its log-probs barely move
    metrics = _run(tmp_path, recipe)
    _assert_rl_steps(metrics, ("time/sync_s", "time/rollout_wait_s"))
    assert metrics["rollout/staleness_max"][3] <= 1
