"""A checkpoint that does not fit its filesystem: a real ENOSPC from a size-limited tmpfs
(mounted in a user namespace of its own, so no root is needed) leaves the previous checkpoint
loadable, no partial folder, and an error that says what to do."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

# Runs inside the namespace, where the tmpfs is mounted at argv[1].
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from mtprun.runner.run import checkpoint

    root = Path(sys.argv[1]) / "checkpoints"
    root.mkdir()

    def state_of(mib):
        def fill(folder):
            torch.save({"w": torch.randn(mib * 2**18)}, folder / "trainer_rank0.pt")
        return fill

    checkpoint.write(root, 1, state_of(1), {"step": 1})
    try:
        checkpoint.write(root, 2, state_of(8), {"step": 2})
        message = None
    except checkpoint.CheckpointWriteError as error:
        message = str(error)
    kept = torch.load(checkpoint.resolve(root, None) / "trainer_rank0.pt")
    print(json.dumps({
        "message": message,
        "steps": checkpoint.steps(root),
        "latest": checkpoint.latest(root),
        "left": sorted(p.name for p in root.iterdir()),
        "loaded_numel": kept["w"].numel(),
    }))
    """
)


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs user namespaces to mount a tmpfs")
def test_a_checkpoint_without_space_fails_clearly_and_keeps_the_previous(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    command = 'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" -c "$3" "$1"'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command, "sh", str(mount), sys.executable, _SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    message = report["message"]
    assert message is not None, "an 8 MiB checkpoint fitted a 4 MiB filesystem"
    assert "checkpoint of step 2 could not be written" in message
    assert "no space left on the filesystem" in message
    assert "checkpoint 1 is intact" in message
    assert "mtprun resume" in message
    assert report["steps"] == [1] and report["latest"] == 1
    assert report["left"] == ["latest", "step_000001"]  # the partial folder is gone
    assert report["loaded_numel"] == 2**18


def test_other_failures_keep_their_type_and_leave_no_partial_folder(tmp_path):
    from mtprun.runner.run import checkpoint

    def crash(folder):
        (folder / "trainer_rank0.pt").write_bytes(b"half")
        raise RuntimeError("trainer rank 1 died")

    with pytest.raises(RuntimeError, match="trainer rank 1 died") as caught:
        checkpoint.write(tmp_path, 3, crash, {"step": 3})
    assert not isinstance(caught.value, checkpoint.CheckpointWriteError)
    assert list(tmp_path.iterdir()) == []
