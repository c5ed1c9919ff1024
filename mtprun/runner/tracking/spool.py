"""The tracking spool: an append-only file of tracking records in the run folder, and a cursor.

<run_dir>/tracking/
  spool.jsonl   one JSON record a line, in the order the run produced them
  cursor.json   {"offset": bytes of spool.jsonl already uploaded, "last_step": newest metrics
                step uploaded}

The run appends (cheap: no network), the tracking writer uploads from the cursor and moves it
past what the server accepted. When everything is uploaded the file is emptied, so its size
is the backlog; `limit_bytes` bounds it. A record uploaded again after a crash between the
upload and the cursor write is harmless: metric records carry their timestamp, and MLflow
stores a metric point once per (key, step, timestamp, value); params, tags, artifacts and
status are overwrites.

Not fsynced per record: a process crash loses nothing (the kernel has the bytes); a machine
crash can lose the newest records, as it can lose the newest steps of the run itself.
"""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

from mtprun.runner.run_dir import write_json_atomic

Record = dict[str, Any]


class Spool:
    """Records in, records out in the same order, each out once it has been committed."""

    def __init__(self, folder: Path, limit_bytes: int = 1 << 30) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "spool.jsonl"
        self.cursor_path = self.folder / "cursor.json"
        self.limit_bytes = limit_bytes
        self.existed = self.cursor_path.exists() or self.path.exists()
        self._lock = threading.Lock()  # the run appends while the writer thread reads/commits
        self._repair()
        cursor = self._read_cursor()
        self._offset = cursor.get("offset", 0)
        self._uploaded_step = cursor.get("last_step", 0)
        self._size = self.path.stat().st_size if self.path.exists() else 0
        pending, _ = self.read(max_records=None)
        self._pending = len(pending)
        self._last_step = max([self._uploaded_step, *map(_step_of, pending)])
        self._out = open(self.path, "ab", buffering=0)  # noqa: SIM115 (open for the run's life)

    # ---- the run's side ------------------------------------------------------------------

    def append(self, record: Record, essential: bool = False) -> bool:
        """Add a record; False (and nothing written) when it would push the backlog past
        `limit_bytes`, unless `essential` (run status: a few bytes that must never be lost).
        OSError (disk full) leaves the spool as it was."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if not essential and self._size - self._offset + len(line) > self.limit_bytes:
                return False
            try:
                _write_all(self._out, line)  # a kill leaves whole lines and one torn tail
            except OSError:  # disk full: leave no partial line for the next record to join
                os.ftruncate(self._out.fileno(), self._size)
                raise
            self._size += len(line)
            self._pending += 1
            self._last_step = max(self._last_step, _step_of(record))
        return True

    @property
    def backlog(self) -> int:
        """Records not yet uploaded."""
        return self._pending

    @property
    def last_step(self) -> int:
        """The newest step of any metrics record ever appended (uploaded or not), 0 if none."""
        return self._last_step

    # ---- the writer's side ---------------------------------------------------------------

    def read(self, max_records: int | None = 500) -> tuple[list[Record], list[int]]:
        """Up to `max_records` records from the cursor, and the file offset after each."""
        with self._lock:
            records: list[Record] = []
            offsets: list[int] = []
            if not self.path.exists():
                return records, offsets
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                while f.tell() < self._size and (max_records is None or len(records) < max_records):
                    line = f.readline()
                    records.append(_parse(line))
                    offsets.append(f.tell())
            return records, offsets

    def commit(self, offset: int, count: int, last_step: int) -> None:
        """`count` records up to file offset `offset` are on the server; newest step among
        them `last_step`. Empties the file once everything is uploaded."""
        with self._lock:
            self._offset = offset
            self._pending -= count
            self._uploaded_step = max(self._uploaded_step, last_step)
            if self._offset == self._size:
                # Truncate first: a crash before the cursor write leaves a cursor past the
                # end, which _repair reads as "all uploaded".
                os.truncate(self.path, 0)
                self._offset = self._size = 0
            self._write_cursor()

    def close(self) -> None:
        self._out.close()

    # ---- opening a spool a previous process left -----------------------------------------

    def _read_cursor(self) -> dict[str, int]:
        try:
            return json.loads(self.cursor_path.read_text())
        except FileNotFoundError:
            return {}

    def _write_cursor(self) -> None:
        write_json_atomic(
            self.cursor_path, {"offset": self._offset, "last_step": self._uploaded_step}
        )

    def _repair(self) -> None:
        """Drop a torn last line (a process killed mid-append); a cursor past the end of the
        file means the file was emptied after a full upload."""
        size = self.path.stat().st_size if self.path.exists() else 0
        if size:
            with open(self.path, "rb+") as f:
                f.seek(max(0, size - (1 << 20)))
                tail = f.read()
                if not tail.endswith(b"\n"):
                    keep = size - len(tail) + tail.rfind(b"\n") + 1
                    f.truncate(keep)
                    size = keep
        cursor = self._read_cursor()
        if cursor.get("offset", 0) > size:
            os.truncate(self.path, 0)
            self._offset, self._uploaded_step = 0, cursor.get("last_step", 0)
            self._write_cursor()


def _write_all(out: io.RawIOBase, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[out.write(view) :]


def _parse(line: bytes) -> Record:
    try:
        return json.loads(line)
    except ValueError:  # cannot happen to lines this module wrote whole; never block on one
        return {"op": "corrupt", "line": line[:200].decode(errors="replace")}


def _step_of(record: Record) -> int:
    return int(record.get("step", 0)) if record.get("op") == "metrics" else 0
