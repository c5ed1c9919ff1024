"""One owner per run folder: `mtprun` in a second process (the test's) on a locked folder
exits 2 naming the holder; a SIGKILLed holder leaves nothing that blocks the next process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from mtprun.cli import main
from mtprun.runner.run.lock import RunFolderLocked, RunLock
from mtprun.runner.run_dir import RunDir

from .cli_run import ENV

_HOLD = (
    "import sys; from pathlib import Path; from mtprun.runner.run.lock import RunLock; "
    "lock = RunLock(Path(sys.argv[1])).acquire('mtprun run'); print('locked', flush=True); "
    "sys.stdin.read()"
)


@pytest.fixture
def holder(tmp_path):
    """A separate process that owns `tmp_path/run` through the same API `mtprun run` uses."""
    root = tmp_path / "run"
    RunDir(root).create().write_state({"tracking_uri": "sqlite:///x.db", "run_id": "r"})
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert proc.stdout.readline().strip() == "locked"
    yield root, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_second_process_exits_2_naming_the_holder(holder, tmp_path, capsys):
    # The commands run in this process, a second one beside the holder (a subprocess each
    # would pay the CLI's imports four times for the same check).
    root, proc = holder
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel: {tiny: {architecture: qwen2, hidden: 64, heads: 2, kv_heads: 1}}\n"
        f"data: {{source: arithmetic}}\nrun_dir: {root}\n"
    )
    holder_text = f"pid {proc.pid} on host {socket.gethostname()}"
    commands = (("resume", root), ("run", recipe), ("run", recipe, "--resume"), ("sync", root))
    for args in commands:
        code = main([str(arg) for arg in args])  # an exception here is the traceback
        err = capsys.readouterr().err
        assert code == 2, err
        assert "in use by another mtprun process" in err
        assert holder_text in err and "Traceback" not in err
    assert json.loads((root / ".lock").read_text())["pid"] == proc.pid  # the loser wrote nothing


def test_a_sigkilled_holder_never_blocks_the_next_owner(holder):
    root, proc = holder
    with pytest.raises(RunFolderLocked, match=f"pid {proc.pid} "):
        RunLock(root).acquire()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (root / ".lock").exists()  # the file stays; the kernel dropped the lock
    with RunLock(root).acquire("mtprun resume") as lock:
        assert lock.held
        owner = json.loads((root / ".lock").read_text())
        assert owner["pid"] == os.getpid() and owner["command"] == "mtprun resume"
    RunLock(root).acquire().release()  # released on exit of the block
