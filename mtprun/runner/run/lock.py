"""One owner per run folder: an exclusive `flock` on `<run_dir>/.lock`.

`mtprun run`, `mtprun resume` and `mtprun sync` hold it for their whole life. The kernel
releases a flock when its holder dies, however it dies (SIGKILL included), so a stale lock
file never blocks the next attempt: only a live process does. The file holds the holder's pid
and host, read back for the message a second process gets. The file itself is never deleted:
unlinking a locked file would let a third process lock a new inode while the first still runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

LOCK_NAME = ".lock"


class RunFolderError(RuntimeError):
    """The run folder cannot be used as asked; the message says what to do instead."""


class RunFolderLocked(RunFolderError):
    """Another live process owns the run folder."""


class RunLock:
    """Exclusive ownership of a run folder for as long as this object holds it."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, command: str = "mtprun") -> RunLock:
        """Take the lock now or raise RunFolderLocked naming the holder (never waits)."""
        # O_CLOEXEC (Python's default) keeps the lock out of exec'd children such as Ray's
        # processes, so it dies with this process and not with the last of them.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderLocked(self._held_message()) from None
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": command}
        owner["since"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def _held_message(self) -> str:
        owner = _read_owner(self.path)
        pid = owner.get("pid", "?")
        who = f"pid {pid} on host {owner.get('host', '?')}"
        if "command" in owner:
            who += f" ({owner['command']}, since {owner.get('since', '?')})"
        folder = self.path.parent
        return (
            f"{folder} is in use by another mtprun process: {who}; only one process may own a "
            f"run folder. Wait for it to end, or stop it with `kill -TERM {pid}` (it checkpoints "
            f"first) and continue with `mtprun resume {folder}`"
        )


def _read_owner(path: Path) -> dict[str, object]:
    """The holder's record; it may be a moment late (the holder writes it after locking)."""
    for _ in range(20):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    return {}
