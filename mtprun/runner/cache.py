"""mtprun's cache directory, where runs keep what later runs can copy instead of making again
(tiny model folders, an empty MLflow store): `$MTPRUN_CACHE_DIR` (default
`$XDG_CACHE_HOME/mtprun`, or `~/.cache/mtprun`); `MTPRUN_CACHE_DIR=` (empty) turns it off."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MTPRUN_CACHE_DIR"


def cache_root() -> Path | None:
    """The cache directory (see the module docstring), None when turned off."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mtprun"
