"""An SFT run joining a separately started Ray head on loopback (`ray start --head`) through
`--ray-address`, as on a cluster, with its trainer split into two pipeline stages of two
context-parallel ranks each (one Ray actor per rank); its metrics read back through the MLflow
client."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mtprun.runner.net import free_port
from mtprun.runner.run import checkpoint

from .cli_run import (
    E2E_TINY,
    ENV,
    RunRecord,
    actor_pids,
    finish,
    start,
    still_running,
    write_recipe,
)

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
STEPS = 6


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on 127.0.0.1 with its own short temp folder, in its own
    process group; stopping that group stops exactly this cluster (`ray stop` would stop
    every Ray instance on the machine). SIGTERM goes to `ray start` alone, which drains the
    node through its GCS and stops the rest in ~2 s; sent to the group, it killed the GCS
    first and `ray start` waited 30 s for it."""
    temp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))
    address = f"127.0.0.1:{free_port()}"
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={address.rsplit(':', 1)[1]}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for_cluster(address, head)
        yield address
    finally:
        head.terminate()
        head.wait(timeout=120)
        with contextlib.suppress(ProcessLookupError):  # whatever outlived it
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_cluster(address: str, head: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited"
        status = subprocess.run(
            [RAY, "status", f"--address={address}"], env=ENV, capture_output=True, timeout=60
        )
        if status.returncode == 0:
            return
        time.sleep(2)
    raise AssertionError(f"the Ray head at {address} did not come up in {timeout} s")


def test_pipelined_sft_run_on_an_existing_ray_cluster(ray_head, tmp_path):
    recipe = write_recipe(
        tmp_path,
        {
            "name": "e2e-sft",
            "run_dir": str(tmp_path / "run"),
            "model": {"tiny": E2E_TINY},
            "data": {"source": "arithmetic", "packing_length": 256, "num_samples": 256},
            "losses": [{"kind": "ce"}, {"kind": "z_loss"}],
            "parallel": {"pp": 2, "cp": 2},
            "resources": {"cpus_per_actor": 0.5},  # four trainer ranks on the head's 2 CPUs
            "trainer": {
                "lr": 3e-3,
                "steps": STEPS,
                "checkpoint_every": 2,
                "keep_checkpoints": 2,
            },
        },
    )
    code, out = finish(start(recipe, "--ray-address", ray_head, cwd=tmp_path))
    assert code == 0, out

    run_dir = tmp_path / "run"
    log = (run_dir / "log.txt").read_text()
    assert f"joining the Ray cluster at {ray_head}" in log
    assert not (run_dir / "ray").exists()  # the cluster's temp folder is the cluster's own
    record = RunRecord(run_dir)
    assert record.run.info.status == "FINISHED"
    assert record.run.info.run_name == "e2e-sft"
    assert record.steps("train/loss") == list(range(1, STEPS + 1))
    for key in (
        "train/ce",
        "train/z_loss",
        "train/entropy",
        "train/trained_token_frac",
        "train/tokens_per_s",
        "time/train_s",
    ):
        assert record.steps(key) == list(range(1, STEPS + 1)), key
    assert "reward/mean" not in record.run.data.metrics  # SFT runs the trainer only
    losses = record.values("train/ce")
    assert losses[-1] < losses[0], losses  # it learns
    assert record.run.data.params["data.source"] == "arithmetic"
    assert (run_dir / "export" / "final" / "model.safetensors").exists()
    # Saved at steps 2, 4 and 6; only the newest two are kept.
    assert checkpoint.steps(run_dir / "checkpoints") == [STEPS - 2, STEPS]
    assert "deleted old checkpoints of steps 2" in log
    assert actor_pids(log) and still_running(actor_pids(log)) == set()  # the cluster keeps running


def test_a_cluster_too_small_for_the_actors_is_waited_for_then_refused(ray_head, tmp_path):
    recipe = write_recipe(
        tmp_path,
        {
            "name": "too-big",
            "run_dir": str(tmp_path / "run"),
            "model": {"tiny": E2E_TINY},
            "data": {"source": "arithmetic"},
            "parallel": {"dp": 3},  # three ranks of one CPU on the head's 2 CPUs
            "resources": {"wait_for_resources_s": 3},
        },
    )
    code, out = finish(start(recipe, "--ray-address", ray_head, cwd=tmp_path))
    assert code == 1, out
    log = (tmp_path / "run" / "log.txt").read_text()
    assert f"waiting up to 3 s for the Ray cluster at {ray_head} to hold 3 CPUs (has 2)" in log
    assert (
        "ClusterTooSmall: the run's actors need 3 CPUs at once, 3 trainer ranks (tp*pp*cp*dp) "
        f"at resources.cpus_per_actor 1 each, and the Ray cluster at {ray_head} (after waiting "
        "3 s) has 2: give Ray more CPUs" in log
    )
    assert "trainer ready" not in log
