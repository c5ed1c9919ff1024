"""The rollout pool on a local Ray instance with a real vLLM engine: an engine process killed
between steps (as the OOM killer would) is noticed by whichever call reaches it next, here
the weight sync; Ray restarts it, the pool syncs the newest weights into it, and its greedy
outputs are those of the new weights."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from mtprun.runner.rollout.pool import RolloutPool

from .conftest import make_recipe
from .test_rollout import MAX_TOKENS, _assert_matches_hf, _retrained

pytestmark = pytest.mark.slow


@pytest.fixture
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="rp", dir="/tmp"))  # Ray's sockets need a short path
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp))
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"process {pid} still alive after SIGKILL"
        time.sleep(0.2)


def test_engine_killed_between_steps_is_restarted_by_the_weight_sync(
    local_ray, tiny_qwen2_dir, tokenizer, tmp_path
):
    recipe = make_recipe(
        tiny_qwen2_dir, rl=True, rollout={"temperature": 0.0, "max_tokens": MAX_TOKENS}
    )
    pool = RolloutPool.start(recipe, tiny_qwen2_dir, tmp_path / "engines")
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    try:
        killed = pool.pids[0]
        os.kill(killed, signal.SIGKILL)
        _wait_gone(killed)

        new_dir = _retrained(tokenizer, tmp_path, "qwen2")
        seconds = pool.update_weights(ray.put(load_file(new_dir / "model.safetensors")), version=1)
        after = pool.generate(prompts, n=1)
    finally:
        pool.shutdown()
    assert pool.restarts == 1
    assert pool.pids[0] != killed
    assert seconds > 0
    assert {sample.version for samples in after for sample in samples} == {1}
    _assert_matches_hf(after, new_dir, prompts, tokenizer.eos_token_id)
