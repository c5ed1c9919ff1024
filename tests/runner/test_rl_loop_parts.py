"""The RL loop's parts a CPU can check: an RL step's wall time split into its parts and the
throughput users compare; on CPUs no GPU engine arguments and no CUDA IPC; an engine that
fails to start says what to change."""

from __future__ import annotations

import random

import pytest
import torch

from mtprun.runner.cuda_ipc import SharedWeights
from mtprun.runner.rollout.vllm_compat import gpu_engine_args
from mtprun.runner.run.steps import step_breakdown


def test_idle_is_what_the_timed_parts_leave_and_throughput_counts_every_gpu():
    rng = random.Random()
    parts = {
        "time/rollout_wait_s": rng.uniform(1, 5),
        "time/logprob_s": rng.uniform(0, 1),
        "time/train_s": rng.uniform(1, 5),
        "time/sync_s": rng.uniform(0, 1),
        "time/engine_sleep_s": rng.uniform(0, 1),
        "time/onload_s": rng.uniform(0, 1),
        "time/offload_s": rng.uniform(0, 1),
    }
    idle = rng.uniform(0, 2)
    step_s = sum(parts.values()) + idle
    tokens = rng.randint(1000, 100000)
    out = step_breakdown({**parts, "time/rollout_s": 99.0, "time/step_s": step_s}, tokens, 2.0)
    assert out["time/idle_s"] == pytest.approx(idle)
    assert out["throughput/tokens_per_s"] == pytest.approx(tokens / step_s)
    assert out["throughput/tokens_per_s_per_gpu"] == pytest.approx(tokens / step_s / 2)


def test_no_gpu_throughput_on_cpus_and_idle_never_negative():
    out = step_breakdown({"time/step_s": 1.0, "time/train_s": 1.5}, 10, 0.0)
    assert out["time/idle_s"] == 0.0
    assert "throughput/tokens_per_s_per_gpu" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answers")
def test_cpu_engines_take_no_gpu_arguments_and_cuda_ipc_refuses_cpu_tensors():
    assert gpu_engine_args(cuda_graphs=True, colocate=True, gpu_memory_utilization=None) == {}
    with pytest.raises(ValueError, match="CUDA IPC shares GPU tensors; the weights are on cpu"):
        SharedWeights({"w": torch.zeros(3)})


def test_an_engine_start_failure_names_what_to_change():
    from mtprun.runner.rollout.pool import _start_error

    memory = RuntimeError(
        "Traceback ...\nValueError: Free memory on device cuda:0 (3.2/79.1 GiB) on startup is "
        "less than desired GPU memory utilization (0.9, 71.2 GiB)."
    )
    text = _start_error(memory)
    assert text.startswith("ValueError: Free memory on device cuda:0")
    assert "lower rollout.gpu_memory_utilization" in text and "placement: split" in text
    driver = RuntimeError("RuntimeError: CUDA driver initialization failed")
    assert "nvidia-smi" in _start_error(driver)
    other = RuntimeError("Traceback\nOSError: model.safetensors is not a safetensors file")
    assert _start_error(other) == "OSError: model.safetensors is not a safetensors file"
