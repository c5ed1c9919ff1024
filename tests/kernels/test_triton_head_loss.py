"""Runs the interpreter tests of the Triton kernels (the head loss's
test_triton_interpreted.py, test_rope.py and test_swiglu.py) in a fresh Python process with
TRITON_INTERPRET=1: triton reads it when it is first imported, and no other test's process
(vLLM imports triton too) may be switched to the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
INTERPRETED = (
    "test_triton_interpreted.py",
    "test_rope.py",
    "test_swiglu.py",
    "test_row_copies_triton.py",
    "test_grouped_wgrad_triton.py",
    "test_rms_norm.py",
)
# A launch's device-function calls patch triton.language once (interpreter_patching.py); the
# plugins these modules do not use stay unloaded (~2.5 CPU-s of imports).
PLUGINS = ["-p", "tests.kernels.interpreter_patching"]
PLUGINS += [f"-pno:{name}" for name in ("hypothesispytest", "anyio", "xdist", "xdist.looponfail")]


def test_kernels_under_the_triton_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    modules = [str(Path(__file__).with_name(name)) for name in INTERPRETED]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGINS, *modules]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
