"""End to end through the `mtprun` console script on a local Ray instance, real vLLM and
Megatron-core engines and a real MLflow store: an SFT warm start then GRPO with asynchronous
rollouts (`rollout.max_staleness: 1`) and the collective weight transfer, stopped with Ctrl-C
(SIGINT) mid-run, resumed, and in the resumed attempt a rollout engine process is SIGKILLed
(as the OOM killer would) and must be restarted with its prompts retried."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtprun.runner.net import free_port
from mtprun.runner.run import checkpoint

from .cli_run import (
    E2E_TINY,
    ENV,
    MTPRUN,
    RunRecord,
    actor_pids,
    finish,
    log_size,
    start,
    still_running,
    wait_for_log,
    write_recipe,
)

pytestmark = pytest.mark.slow

WARMSTART_STEPS, GRPO_STEPS = 2, 12
TOTAL = WARMSTART_STEPS + GRPO_STEPS
# SIGINT once step 3 (the first GRPO step) is logged: tiny steps run ahead of the signal (a
# CI run stopped after step 9 of 10, another finished first), so most of the run is left.
STOP_AFTER = 3
STALENESS = 1


def grpo_recipe(run_dir: Path) -> dict:
    """The tiny warm-start + GRPO recipe of these runs (other e2e tests vary it): a Qwen3 (q/k
    norms), so that family's SFT, GRPO, weight transfers and resume run end to end here."""
    return {
        "name": "e2e-grpo",
        "run_dir": str(run_dir),
        "model": {"tiny": {**E2E_TINY, "architecture": "qwen3"}},
        "warmstart": {
            "data": {"source": "arithmetic", "packing_length": 256, "num_samples": 128},
            "steps": WARMSTART_STEPS,
            "lr": 1e-3,
        },
        "task": {
            "name": "arithmetic",
            "reward": "arithmetic",
            "samples_per_prompt": 4,
            "prompts_per_step": 4,
        },
        "losses": [{"kind": "grpo", "kl_coef": 0.01}, {"kind": "entropy"}],
        # The trainer recomputes the old log-probs: train/logprob_mismatch compares them with
        # the engines' sampling ones.
        "rollout": {"max_tokens": 8, "max_staleness": STALENESS, "recompute_logprobs": True},
        "trainer": {
            "lr": 1e-4,
            "steps": GRPO_STEPS,
            "micro_batch_tokens": 512,
            "checkpoint_every": 4,
        },
        "resources": {"num_cpus": 2},
    }


@pytest.fixture(scope="module")
def grpo_run():
    """Run, stop, resume (with an engine killed): the run folder and what each attempt did."""
    # A short folder: Ray's Unix sockets live under <run_dir>/ray.
    root = Path(tempfile.mkdtemp(prefix="mtp", dir="/tmp"))
    run_dir = root / "run"
    recipe = write_recipe(root, grpo_recipe(run_dir))
    log_file = run_dir / "log.txt"

    first = start(recipe, cwd=root)
    wait_for_log(log_file, rf"DEBUG step {STOP_AFTER}:", first)
    first.send_signal(signal.SIGINT)
    first_code, first_out = finish(first)
    first_status = RunRecord(run_dir).run.info.status
    assert first_code == 130, f"the SIGINT did not stop the first attempt:\n{first_out[-3000:]}"

    # In the resumed attempt, SIGKILL the rollout engine once the attempt logged its first
    # step: the engine is generating the next steps' rollouts then, and every step left needs
    # it (the first attempt stopped near step STOP_AFTER of TOTAL). Not as soon as it is up:
    # the resume's first weight push forms the transfer group right then, and a member killed
    # while it forms holds the formation for its 60 s timeout.
    since = log_size(log_file)
    second = start("resume", run_dir, cwd=root)
    ready = wait_for_log(log_file, r"rollout engines ready: pids \[(\d+)\]", second, since)
    wait_for_log(log_file, r"DEBUG step \d+:", second, ready.end())
    engine_pid = int(ready.group(1))
    os.kill(engine_pid, signal.SIGKILL)
    second_code, second_out = finish(second)
    yield {
        "run_dir": run_dir,
        "first": (first_code, first_out, first_status),
        "second": (second_code, second_out),
        "engine_pid": engine_pid,
    }
    shutil.rmtree(root, ignore_errors=True)


def test_ctrl_c_stops_cleanly_and_resume_completes_every_step_once(grpo_run):
    code, out, status = grpo_run["first"]
    assert code == 130, out
    assert status == "KILLED"
    assert "continue with: mtprun resume" in out
    code, out = grpo_run["second"]
    assert code == 0, out
    record = RunRecord(grpo_run["run_dir"])
    assert record.run.info.status == "FINISHED"
    assert record.steps("train/loss") == list(range(1, TOTAL + 1))
    assert record.steps("reward/mean") == list(range(WARMSTART_STEPS + 1, TOTAL + 1))
    # The stop checkpointed the step it stopped after, and the resume started right there.
    log = (grpo_run["run_dir"] / "log.txt").read_text()
    stopped = int(log.split("stopped after step ")[1].split(";")[0])
    assert f"resuming after step {stopped} " in log
    # Its output is a pipe, no terminal: each step's summary is printed as it ends (a live
    # bar would be drawn only once, at the end).
    for step in range(stopped + 1, TOTAL + 1):
        assert f"step {step} | " in out, out[-3000:]


def test_no_episode_trains_a_policy_more_than_max_staleness_steps_newer(grpo_run):
    record = RunRecord(grpo_run["run_dir"])
    oldest = record.values("rollout/staleness_max")
    mean = record.values("rollout/staleness")
    assert record.steps("rollout/staleness_max") == list(range(WARMSTART_STEPS + 1, TOTAL + 1))
    assert max(oldest) == STALENESS  # the rollouts ran ahead of the trainer
    assert all(0 <= m <= s <= STALENESS for m, s in zip(mean, oldest, strict=True))
    # Each attempt's first step is sampled by the weights it started from.
    assert oldest[0] == 0


def test_the_engines_sample_with_the_trainers_weights_from_the_first_rl_step(grpo_run):
    """The engines loaded during the warm start, from the model it started from; the GRPO
    stage pushed the warm-started weights into them first (unpushed, the first step would train
    on samples of the untrained model, policy version 0, which the staleness bound refuses).
    Their log-probs equal the trainer's recomputed ones at every step (1.5-1.9e-7 a token
    measured, float32 both; staleness 1 at lr 1e-4 adds little)."""
    record = RunRecord(grpo_run["run_dir"])
    mismatch = record.values("train/logprob_mismatch")
    assert record.steps("train/logprob_mismatch") == list(range(WARMSTART_STEPS + 1, TOTAL + 1))
    assert all(0 <= m < 1e-4 for m in mismatch), mismatch


def test_killed_rollout_engine_is_restarted_and_its_prompts_retried(grpo_run):
    log = (grpo_run["run_dir"] / "log.txt").read_text()
    assert f"rollout engine 0 (pid {grpo_run['engine_pid']}) died" in log
    assert "rollout engine 0 restarted (new pid" in log
    record = RunRecord(grpo_run["run_dir"])
    restarts = record.values("rollout/engine_restarts")
    assert restarts[-1] == 1.0, restarts
    # Every step, the ones after the kill included, trained on its episodes.
    assert min(record.values("train/trained_tokens")) > 0
    pids = actor_pids(log)
    assert grpo_run["engine_pid"] in pids and len(pids) >= 3  # trainer, engine, restarted engine
    assert still_running(pids) == set()  # nothing left running after the run


def test_metrics_params_tags_and_artifacts_land_in_mlflow(grpo_run):
    record = RunRecord(grpo_run["run_dir"])
    metrics = record.run.data.metrics
    for key in (
        "reward/mean",
        "reward/std",
        "response/length",
        "train/trained_token_frac",
        "train/tokens_per_s",
        "rollout/tokens_per_s",
        "rollout/tool_turns",
        "time/rollout_s",
        "time/train_s",
        "time/sync_s",
        "time/rollout_wait_s",
        "time/sync_wait_s",
        "rollout/staleness",
        "train/loss",
        "train/grpo",
        "train/grpo/clip_frac",
        "train/grpo/kl",
        "train/entropy",
        "train/grad_norm",
    ):
        assert key in metrics, sorted(metrics)
    assert 0.0 <= metrics["reward/mean"] <= 1.0
    assert metrics["rollout/tool_turns"] == 0.0  # one turn per episode: no tool answers
    # The engines' own generate seconds, inside each step's generation. The SIGKILLed
    # engine's count dies with it: the step whose rollouts it had generated may read 0.
    generate, rollout = record.values("time/engine_generate_s"), record.values("time/rollout_s")
    assert record.steps("time/engine_generate_s") == record.steps("time/rollout_s")
    assert all(0.0 <= g <= r for g, r in zip(generate, rollout, strict=True)), (generate, rollout)
    assert sum(g == 0.0 for g in generate) <= 1, generate
    assert metrics["rollout/engine_tokens_per_s"] > 0.0
    assert 0.0 < metrics["train/trained_token_frac"] < 1.0  # the prompt is never trained
    params = record.run.data.params
    assert params["task.name"] == "arithmetic"
    assert params["losses.0.kind"] == "grpo"
    tags = record.run.data.tags
    plan = json.loads((grpo_run["run_dir"] / "plan.json").read_text())
    from mtprun.compiler import HeadPlan

    assert tags["mtprun.plan_hash"] == HeadPlan.from_json(json.dumps(plan)).hash
    assert tags["mtprun.git_commit"] not in ("", "unknown")
    assert Path(tags["mtprun.checkpoint"]).name == f"step_{TOTAL:06d}"
    assert {"recipe.yaml", "plan.json", "plans", "samples"} <= record.artifacts()
    samples = record.artifacts("samples")
    assert f"samples/step_{TOTAL:06d}.txt" in samples


def test_export_is_an_hf_folder_transformers_loads(grpo_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = grpo_run["run_dir"]
    out = run_dir / "export" / "warmstart-end"
    done = subprocess.run(
        [*MTPRUN, "export", str(run_dir), "--step", str(WARMSTART_STEPS), "--out", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    saved = load_file(out / "model.safetensors")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    ids = tokenizer("12+7=", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # The GRPO stage started from this very folder (its engines, loaded during the warm
    # start, took these weights by a sync).
    source = run_dir / "checkpoints" / f"step_{WARMSTART_STEPS:06d}" / "hf"
    log = (run_dir / "log.txt").read_text()
    assert f"stage grpo: steps {WARMSTART_STEPS + 1}..{TOTAL} from {source}" in log
    assert (source / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    # Checkpoints: 2 (warm start end), 4, 8, 12, the stop step (wherever the SIGINT landed), 14.
    steps = sorted(checkpoint.steps(run_dir / "checkpoints"))
    missing = min(set(range(1, TOTAL)) - set(steps))
    bad = subprocess.run(
        [*MTPRUN, "export", str(run_dir), "--step", str(missing)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert f"no checkpoint for step {missing}" in bad.stderr
    # The stop step may be 3, right after the warm start's: the list is whatever was written.
    assert f"available steps: {', '.join(map(str, steps))}" in bad.stderr


def test_ui_serves_the_run_to_a_real_browser(grpo_run, chromium):
    port = free_port()
    ui = subprocess.Popen(
        [*MTPRUN, "ui", str(grpo_run["run_dir"]), "--port", str(port)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        runs_url = ui.stdout.readline().strip().rsplit(" ", 1)[-1]
        run_url = ui.stdout.readline().strip().rsplit(" ", 1)[-1]
        address = f"http://127.0.0.1:{port}"
        _wait_healthy(address, ui)
        record = RunRecord(grpo_run["run_dir"])
        # The address to open is the training-runs view of the run's experiment (MLflow's
        # bare address shows its home page, an experiment's own page its overview).
        runs_view = f"{address}/#/experiments/{record.run.info.experiment_id}/runs"
        assert runs_url == runs_view
        assert run_url == f"{runs_view}/{record.run_id}"
        assert "e2e-grpo" in _rendered_dom(chromium, runs_url)  # listed there
        dom = _rendered_dom(chromium, run_url)
        assert "e2e-grpo" in dom
        assert "reward/mean" in dom
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium; installed with apt when missing (root only)."""
    found = shutil.which("chromium")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        apt = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], env=apt, check=True, capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
            env=apt,
            check=True,
            capture_output=True,
        )
        found = shutil.which("chromium")
    if found is None:
        pytest.fail("chromium is missing: apt-get install -y --no-install-recommends chromium")
    return found


def _rendered_dom(chromium: str, url: str) -> str:
    """The page's DOM after its scripts ran, from headless chromium."""
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        done = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-dev-shm-usage",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=20000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _wait_healthy(address: str, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "mtprun ui exited before serving"
        try:
            with urllib.request.urlopen(f"{address}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{address}/health did not answer in {timeout} s")
