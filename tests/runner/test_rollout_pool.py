"""The rollout pool on a local Ray instance with a real vLLM engine: an engine process killed
between steps (as the OOM killer would) is noticed by whichever call reaches it next, here
the weight sync; Ray restarts it, the pool syncs the newest weights into it, and its greedy
outputs are those of the new weights. An engine that Ray restarted before any call of the
pool failed on it (it died while a weight-transfer group waited for it to join) is noticed by
`revive` from its new pid, and synced the same way. An engine that dies part way through an
update in parts misses the rest of the stream, which goes on to its end, and is then restarted
and streamed into alone."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from safetensors.torch import load_file

from mtprun.runner.rollout.pool import RolloutPool

from .conftest import make_recipe
from .test_rollout import MAX_TOKENS, _assert_matches_hf, _layer_parts, _retrained

pytestmark = pytest.mark.slow


def _kill(pid: int, timeout: float = 60) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"process {pid} still alive after SIGKILL"
        time.sleep(0.2)


def _restarted_pid(actor: Any, timeout: float = 300) -> int:
    """The pid of `actor` once Ray restarted it, asked directly (not through the pool)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(actor.pid.remote())
        except (ActorUnavailableError, RayActorError):
            assert time.monotonic() < deadline, "Ray did not restart the engine"
            time.sleep(0.5)


def test_engine_killed_between_steps_is_restarted_by_the_weight_sync(
    local_ray, tiny_qwen2_dir, tokenizer, tmp_path
):
    recipe = make_recipe(
        tiny_qwen2_dir, rl=True, rollout={"temperature": 0.0, "max_tokens": MAX_TOKENS}
    )
    pool = RolloutPool.launch(recipe, tiny_qwen2_dir, tmp_path / "engines").ready()
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    try:
        killed = pool.pids[0]
        _kill(killed)

        new_dir = _retrained(tokenizer, tmp_path, "qwen2")
        seconds = pool.update_weights(ray.put(load_file(new_dir / "model.safetensors")), version=1)
        after = pool.generate(prompts, n=1)
        assert pool.restarts == 1
        assert pool.pids[0] != killed
        assert seconds > 0
        assert {sample.version for samples in after for sample in samples} == {1}
        _assert_matches_hf(after, new_dir, prompts, tokenizer.eos_token_id)

        killed = pool.pids[0]
        _kill(killed)
        restarted = _restarted_pid(pool.actors[0])  # on the stage's initial weights
        assert pool.revive()
        again = pool.generate(prompts, n=1)
        assert pool.restarts == 2
        assert pool.pids[0] == restarted != killed
        # Brought back to the newest weights, version 1.
        assert {sample.version for samples in again for sample in samples} == {1}
        _assert_matches_hf(again, new_dir, prompts, tokenizer.eos_token_id)

        # An update in parts (a colocated sync's way) during which the engine dies: the
        # stream is taken to its end, then the restarted engine gets a stream of its own.
        parts = _layer_parts(load_file(new_dir / "model.safetensors"))
        taken: list[int] = []

        def stream(kill_after: int | None):
            for k, part in enumerate(parts):
                taken.append(k)
                yield [part]  # engine 0's item
                if k == kill_after:
                    _kill(pool.pids[0])

        def resync(i: int) -> float:
            seconds, dead = pool.stream_update(stream(None), 2, [i], load="load_part")
            assert dead == []
            return seconds[i]

        pool.resync = resync
        killed = pool.pids[0]
        seconds = pool.update_weights_in_parts(stream(kill_after=0), 2, load="load_part")
        parted = pool.generate(prompts, n=1)
    finally:
        pool.shutdown()
    assert taken == [*range(len(parts))] * 2  # the whole stream, then the resync's
    assert pool.restarts == 3 and pool.pids[0] != killed
    assert seconds > 0
    assert {sample.version for samples in parted for sample in samples} == {2}
    _assert_matches_hf(parted, new_dir, prompts, tokenizer.eos_token_id)
