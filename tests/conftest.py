"""Suite-wide collection order: `make test` runs the suite on two pytest-xdist workers that take
whole test files (`--dist loadfile`), each file handed out in collection order when a worker runs
low, so the longest files go first and the many short files fill the workers' gaps at the end
instead of leaving one worker alone with a long file (longest-processing-time-first).

xdist's own default for `--dist loadfile` reorders the files by their number of tests, most
first (`--loadscope-reorder`): that put the end-to-end files, a few tests of minutes each, last.
`pytest_configure` turns it off, so the order below is the order the workers get.

Which files share a worker thus changes with the list; a file leaves torch.compile as it found
it (`_torch_compile_as_found`), since an in-process vLLM engine turns it off for its process."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Seconds each of the longest files takes in a full `make test` run on a 2-core machine
# (setup + call + teardown: the 30 slowest of two runs of 2026-11-27, and files alone with
# --durations=0, scaled for the other worker's load), longest first. Approximate and kept
# short: only the order matters. Files not named come after them, those with a `slow` test
# first, each group in collection order.
LONGEST_FILES_S = {
    "tests/runner/test_mtp_specdec.py": 300,
    "tests/runner/test_run_grpo.py": 230,
    "tests/runner/test_lora_rollout.py": 200,
    "tests/runner/test_run_trainer_restart.py": 135,
    "tests/runner/test_run_user_task.py": 110,
    "tests/runner/test_run_agentic.py": 105,
    "tests/runner/test_run_policy_losses.py": 105,
    "tests/runner/test_weight_transfer.py": 100,
    "tests/runner/test_tracking_outage.py": 95,
    "tests/runner/test_run_verifiers.py": 90,
    "tests/runner/test_run_cluster.py": 90,
    "tests/runner/test_run_reward_models.py": 85,
    "tests/runner/test_run_search.py": 75,
    "tests/runner/test_family_rollouts.py": 80,
    "tests/runner/test_rollout_pool.py": 70,
    "tests/runner/test_reward_models.py": 65,
    # Mostly waiting (Ray's 30 s registration wait runs out): early, beside a busy file.
    "tests/runner/test_ray_start.py": 60,
    "tests/kernels/test_triton_head_loss.py": 55,
    "tests/runner/test_qwen3_5.py": 50,
    "tests/data/test_sft.py": 45,
    "tests/runner/test_lora_layouts.py": 45,
    "tests/runner/test_rollout.py": 45,
    "tests/runner/test_partial_rollouts.py": 45,
    "tests/runner/test_qwen3_moe.py": 40,
    "tests/runner/test_cli_errors.py": 40,
    "tests/runner/test_trainer.py": 35,
    "tests/runner/test_glm4_moe.py": 35,
    "tests/runner/test_adamw_interpreted.py": 30,
    "tests/cli/test_ui.py": 30,
}


# The session's caches, shared by this process, Ray actors and `mtprun` subprocesses (they
# inherit the variables) and made in the xdist controller (which loads no tests/*/conftest.py)
# so both workers inherit the same ones: vLLM's, where an engine inspects its model class in
# a subprocess that imports vLLM (~9 CPU-s a class on a 2-core machine; a run folder's own
# cache is cold for every run, and with a cache each both workers inspected every class they
# ran), and mtprun's, where a run's tiny model folder is built once per recipe model (~7
# CPU-s a build). Both are written atomically, so two workers may fill them at once; the
# session's first engine of each class and first run of each tiny model still go the cold way.
_SESSION_CACHES = {"VLLM_CACHE_ROOT": "vllm-cache-", "MTPRUN_CACHE_DIR": "mtprun-cache-"}
_session_cache_dirs = pytest.StashKey[dict[str, str]]()

# OpenMP threads that wait for work sleep instead of spinning (libgomp, torch's CPU backend,
# spins ~300k iterations after each parallel region unless told otherwise). Under `make test`
# two workers and each end-to-end run's Ray actors (2 torch threads each) share 2 cores, and a
# spinning thread takes the core another process needs: two end-to-end files at once
# (test_run_agentic beside test_run_search) took 195 and 205 CPU-s, 115 and 120 s, spinning,
# 185 and 182 CPU-s, 107 and 103 s, sleeping. Set in the controller, so the workers, `mtprun`
# subprocesses and Ray actors inherit it before they load torch; an explicit setting wins.
# Only how idle threads wait changes: the same threads split the same work.
_SESSION_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
_session_env_set = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    """Files in collection order under `--dist loadfile`; the session's caches and OpenMP's
    wait policy (above)."""
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # hand the files out in collection order
    config.stash[_session_env_set] = [v for v in _SESSION_ENV if v not in os.environ]
    for variable in config.stash[_session_env_set]:
        os.environ[variable] = _SESSION_ENV[variable]
    made = config.stash[_session_cache_dirs] = {}
    for variable, prefix in _SESSION_CACHES.items():
        if variable not in os.environ:
            os.environ[variable] = made[variable] = tempfile.mkdtemp(prefix=prefix)


def pytest_unconfigure(config: pytest.Config) -> None:
    for variable, folder in config.stash.get(_session_cache_dirs, {}).items():
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[variable]
    for variable in config.stash.get(_session_env_set, []):
        os.environ.pop(variable, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> tuple[float, bool]:
        seconds = LONGEST_FILES_S.get(item.nodeid.split("::", 1)[0])
        return (-seconds if seconds is not None else 0.0, item.path not in slow_files)

    items.sort(key=rank)  # stable: a file's tests stay together and in their order


@pytest.fixture(autouse=True, scope="module")
def _torch_compile_as_found():
    """torch.compile back as it was before the module: an in-process rollout engine
    (`configure_vllm_env`) disables it for the rest of its process, and the next file on the
    same worker (flex attention's compiled kernels, say) must not inherit that."""
    import torch

    variable = os.environ.get("TORCH_COMPILE_DISABLE")
    disabled = torch._dynamo.config.disable
    yield
    torch._dynamo.config.disable = disabled
    if variable is None:
        os.environ.pop("TORCH_COMPILE_DISABLE", None)
    else:
        os.environ["TORCH_COMPILE_DISABLE"] = variable
