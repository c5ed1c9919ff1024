"""Local dataset files read with Hugging Face `datasets`: memory-mapped Arrow tables.

A path is a `.jsonl`, `.parquet`, `.arrow` or `.csv` file, a folder of such files (one
format, read in name order as one table), or a folder written by `datasets.save_to_disk`.
Rows stay on disk: Arrow files and `save_to_disk` folders are mapped as they are; parquet and
csv files are copied batch by batch into an Arrow file that is mapped; a `.jsonl` file is
copied the same way as its raw lines, so that a line which is not valid JSON is one bad
record, reported by its line number, and not a failure of the whole file.

A bad record does not cost the good ones: the caller parses each row, reports every bad one
as `file:line: reason` (`.jsonl`) or `file: row N: reason` (0-based rows of other files) and
keeps the rest (`scan`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)
SUFFIXES = (".jsonl", ".parquet", ".arrow", ".csv")
_SCAN_BATCH = 1024  # rows per Arrow batch while scanning: bounds the memory of a scan
_RAW = "__mtprun_line__"  # the raw-text column of a .jsonl file's Arrow copy
_LINE = "__mtprun_line_number__"


class DataFileError(ValueError):
    """A dataset cannot be used at all (missing, unreadable, or not one good record)."""


@dataclass(frozen=True)
class RecordError:
    """A bad record: its file, its line (.jsonl, 1-based) or row (0-based), and why."""

    path: Path
    line: int
    reason: str
    unit: str = "line"

    def __str__(self) -> str:
        if self.unit == "line":
            return f"{self.path}:{self.line}: {self.reason}"
        return f"{self.path}: row {self.line}: {self.reason}"


@dataclass
class Table:
    """A dataset as one memory-mapped table, with where each of its rows came from."""

    path: Path  # what the recipe named
    dataset: Any  # datasets.Dataset
    files: list[Path]
    starts: list[int]  # first row of each file
    is_jsonl: bool

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def columns(self) -> list[str]:
        if self.is_jsonl:
            return []  # every record has its own keys
        return list(self.dataset.column_names)

    @property
    def fingerprint(self) -> str:
        """A hash that changes when a file the table reads changes (its path, size or
        modification time), without reading any of them."""
        stats = []
        for source in self.files:
            for file in sorted(source.rglob("*")) if source.is_dir() else [source]:
                if file.is_file():
                    stat = file.stat()
                    stats.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns))
        return hashlib.sha256(json.dumps(stats).encode()).hexdigest()

    def record(self, row: int) -> dict[str, Any]:
        """Row `row` as a dict of its columns (a .jsonl line as its JSON object).
        Raises ValueError when a .jsonl line is not a JSON object."""
        return _decoded(self.dataset[int(row)], self.is_jsonl)

    def batches(self, columns: list[str] | None) -> Iterator[tuple[int, list[Any]]]:
        """(first row, records) of consecutive batches; only `columns` are read (None: all).
        A record is the decoded row, or the ValueError that decoding it raised."""
        data = self.dataset
        if columns is not None and not self.is_jsonl:
            data = data.select_columns([c for c in columns if c in data.column_names])
        start = 0
        for batch in data.iter(batch_size=_SCAN_BATCH):
            size = len(next(iter(batch.values()))) if batch else 0
            rows = [{k: v[i] for k, v in batch.items()} for i in range(size)]
            yield start, [_decoded_or_error(row, self.is_jsonl) for row in rows]
            start += size

    def where(self, row: int, reason: str) -> RecordError:
        """The error of row `row`, located in its file."""
        index = bisect.bisect_right(self.starts, row) - 1
        if self.is_jsonl:
            line = int(self.dataset[int(row)][_LINE])
            return RecordError(self.files[index], line, reason)
        return RecordError(self.files[index], row - self.starts[index], reason, unit="row")


def scan(
    table: Table, parse: Callable[[dict[str, Any]], object], columns: list[str] | None
) -> tuple[np.ndarray, list[RecordError]]:
    """The rows `parse` accepts (it raises ValueError on a bad one) and an error per bad row.
    Only the good rows' indices are kept, never the parsed records."""
    good: list[int] = []
    errors: list[RecordError] = []
    for start, records in table.batches(columns):
        for offset, record in enumerate(records):
            try:
                if isinstance(record, ValueError):
                    raise record
                parse(record)
                good.append(start + offset)
            except ValueError as err:
                errors.append(table.where(start + offset, str(err)))
    _release_arrow_memory()
    for error in errors:
        logger.warning("skipping bad record %s", error)
    if not good:
        details = "".join(f"\n  {e}" for e in errors[:50]) or " (it has no rows)"
        more = f"\n  ... and {len(errors) - 50} more" if len(errors) > 50 else ""
        raise DataFileError(f"no usable record in {table.path}:{details}{more}")
    return np.asarray(good, dtype=np.int64), errors


def open_table(path: str | Path, cache_dir: str | Path | None = None) -> Table:
    """The dataset at `path` as one memory-mapped table; raises DataFileError."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return _saved_dataset(path)
        if (path / "dataset_dict.json").is_file():
            raise DataFileError(
                f"{path} holds a DatasetDict (several splits): point at one split's folder, "
                f"such as {path / 'train'}"
            )
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise DataFileError(
                f"no data file in folder {path} (looked for {', '.join(SUFFIXES)} files, "
                "or a datasets.save_to_disk folder)"
            )
    elif path.is_file():
        files = [path]
    else:
        raise DataFileError(f"cannot read data file {path}: no such file or folder")
    suffixes = sorted({p.suffix for p in files})
    if len(suffixes) > 1:
        raise DataFileError(f"folder {path} mixes {', '.join(suffixes)} files: keep one format")
    if suffixes[0] not in SUFFIXES:
        raise DataFileError(f"{path}: a dataset file ends in {', '.join(SUFFIXES)}")
    return _files_table(path, files, suffixes[0], cache_dir)


def _files_table(path: Path, files: list[Path], suffix: str, cache_dir: str | Path | None) -> Table:
    import datasets

    datasets.disable_progress_bars()
    parts = []
    for file in files:
        try:
            if suffix == ".arrow":
                parts.append(datasets.Dataset.from_file(str(file)))
            else:
                parts.append(_converted(file, suffix, cache_dir))
        except OSError as err:
            raise DataFileError(f"cannot read data file {file}: {err}") from err
        except Exception as err:  # pyarrow and datasets raise many kinds for a broken file
            raise DataFileError(
                f"cannot read data file {file}: {type(err).__name__}: {err}"
            ) from err
    starts = np.cumsum([0, *(len(p) for p in parts[:-1])]).tolist()
    try:
        dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    except ValueError as err:
        raise DataFileError(f"the files of {path} do not share columns: {err}") from err
    return Table(path, dataset, files, starts, is_jsonl=suffix == ".jsonl")


def _saved_dataset(path: Path) -> Table:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:
        raise DataFileError(f"cannot load the saved dataset {path}: {err}") from err
    if isinstance(dataset, datasets.DatasetDict):
        raise DataFileError(f"{path} holds several splits: point at one split's folder")
    return Table(path, dataset, [path], [0], is_jsonl=False)


def _converted(file: Path, suffix: str, cache_dir: str | Path | None) -> Any:
    """`file` copied batch by batch into an Arrow file that is read back memory-mapped: the
    file is never held whole. The copy is unlinked once mapped (the mapping keeps it
    readable), so nothing is left behind."""
    import datasets
    import pyarrow as pa

    batches = _jsonl_batches(file) if suffix == ".jsonl" else _table_batches(file, suffix)
    folder = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    handle, arrow_path = tempfile.mkstemp(prefix=f"{file.stem}-", suffix=".arrow", dir=folder)
    os.close(handle)
    try:
        first = next(batches)
        with pa.OSFile(arrow_path, "wb") as sink, pa.ipc.new_stream(sink, first.schema) as out:
            out.write_batch(first)
            for batch in batches:
                out.write_batch(batch)
        _release_arrow_memory()
        return datasets.Dataset.from_file(arrow_path)
    finally:
        os.unlink(arrow_path)


def _table_batches(file: Path, suffix: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet as pq

    if suffix == ".parquet":
        # One row group at a time: ParquetFile.iter_batches keeps what it decoded alive
        # until the reader closes (pyarrow 25), i.e. the whole file by the end.
        reader = pq.ParquetFile(file)
        schema = reader.schema_arrow
        batches: Iterator[Any] = (
            batch
            for group in range(reader.num_row_groups)
            for batch in reader.read_row_group(group, use_threads=False).to_batches(_SCAN_BATCH)
        )
    else:
        reader = pyarrow.csv.open_csv(file)
        schema = reader.schema
        batches = iter(reader)
    yielded = False
    for batch in batches:
        yielded = True
        yield batch
    if not yielded:
        yield pa.RecordBatch.from_pylist([], schema=schema)


def _jsonl_batches(file: Path) -> Iterator[Any]:
    """The file's non-blank lines, raw, with their line numbers."""
    import pyarrow as pa

    schema = pa.schema([(_RAW, pa.large_string()), (_LINE, pa.int64())])
    texts: list[str] = []
    numbers: list[int] = []
    with open(file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                texts.append(line)
                numbers.append(number)
            if len(texts) == _SCAN_BATCH:
                yield pa.record_batch([texts, numbers], schema=schema)
                texts, numbers = [], []
    yield pa.record_batch([texts, numbers], schema=schema)


def _release_arrow_memory() -> None:
    # Arrow's allocator keeps the pages of freed batches resident unless asked to return them.
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _decoded(row: dict[str, Any], is_jsonl: bool) -> dict[str, Any]:
    if not is_jsonl:
        return row
    try:
        record = json.loads(row[_RAW])
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON: {err.msg}") from None
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object, got {type(record).__name__}")
    return record


def _decoded_or_error(row: dict[str, Any], is_jsonl: bool) -> dict[str, Any] | ValueError:
    try:
        return _decoded(row, is_jsonl)
    except ValueError as err:
        return err
