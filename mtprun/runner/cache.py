"""mtprun's cache directory, where runs keep what later runs can copy instead of making again
(tiny model folders, an empty MLflow store): `$MTPRUN_CACHE_DIR` (default
`$XDG_CACHE_HOME/mtprun`, or `~/.cache/mtprun`); `MTPRUN_CACHE_DIR=` (empty) turns it off.
An entry is made in a scratch folder beside it and renamed into place (`add_to_cache`), so a
crash mid-make leaves no entry and of two processes making it at once one's stays."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "MTPRUN_CACHE_DIR"


def cache_root() -> Path | None:
    """The cache directory (see the module docstring), None when turned off."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mtprun"


def add_to_cache(entry: Path, make: Callable[[Path], Path]) -> None:
    """`make(scratch)` writes the entry in a fresh scratch folder beside `entry` and returns
    the path it wrote (the folder itself, or a file in it), which becomes `entry`. Raises
    OSError where the cache cannot be written."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".making-", dir=entry.parent))
    try:
        made = make(scratch)
        try:
            made.rename(entry)
        except OSError:
            if not entry.exists():  # not another process's entry
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
