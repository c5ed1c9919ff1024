"""Runs `test_adamw_kernel.py` (AdamW with bfloat16 moments) on CPU in a fresh Python process
with TRITON_INTERPRET=1: triton reads it when it is first imported, and no other test's process
(vLLM imports triton too) may be switched to the interpreter. Where a GPU is, that module runs
on it directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
# The module takes no fixtures: no conftest.py (tests/runner's imports transformers and builds
# the tiny models, ~8 CPU-s), and none of the plugins it does not use (~2.5 CPU-s). A launch's
# device-function calls patch triton.language once (tests/kernels/interpreter_patching.py).
OPTIONS = ["--noconftest", "-p", "tests.kernels.interpreter_patching"]
OPTIONS += [f"-pno:{name}" for name in ("hypothesispytest", "anyio", "xdist", "xdist.looponfail")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="test_adamw_kernel.py runs on the GPU")
def test_adamw_kernel_under_the_triton_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    module = str(Path(__file__).with_name("test_adamw_kernel.py"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *OPTIONS, module]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
