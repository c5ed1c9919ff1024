"""The tracking writer: a background thread that uploads the spool to MLflow in order.

Training never waits on it. While the server is unreachable it retries (1 s, doubling to
`max_retry_s`), logs one warning per outage with the backlog size, and says when the server
is back. `close(timeout)` waits for the backlog at most `timeout` seconds: what is left stays in
the spool for the next `mtprun resume` or `mtprun sync`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from mtprun.runner.tracking.spool import Record, Spool

log = logging.getLogger("mtprun")

# MLflow's log_batch limits: 1000 metrics, 100 params, 100 tags per call.
_MAX_METRICS, _MAX_KEYS = 1000, 100

# The MLflow client's own retries (7, with backoff up to minutes) would hide an outage behind
# one endless call; the writer retries on its own schedule, so each call fails fast instead.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def fail_fast_http() -> None:
    """Short MLflow HTTP retries and timeout for this process, unless the user set them."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


class TrackingWriter:
    """Uploads `spool` into MLflow run `run_id` from a daemon thread."""

    def __init__(
        self,
        spool: Spool,
        client: MlflowClient,
        run_id: str,
        max_retry_s: float = 10.0,
        meanwhile: str = "training goes on",
    ) -> None:
        self.spool = spool
        self.meanwhile = meanwhile  # what the outage warning says happens in the meantime
        self.client = client
        self.run_id = run_id
        self.max_retry_s = max_retry_s
        self.outage: str | None = None  # why the last upload failed, while it is failing
        self.uploaded = 0  # records uploaded by this writer
        self._wake = threading.Event()  # new records (ignored while backing off)
        self._retry_now = threading.Event()  # closing: cut the current back-off short
        self._closing = False
        self._abandon = False
        self._thread = threading.Thread(target=self._loop, name="mtprun-tracking", daemon=True)

    def start(self) -> TrackingWriter:
        self._thread.start()
        return self

    def wake(self) -> None:
        """New records are in the spool."""
        self._wake.set()

    def close(self, timeout: float) -> bool:
        """Upload what is left for at most `timeout` seconds; True when the spool is empty.
        An upload still in flight at the deadline is abandoned (the daemon thread dies with the
        process; the record stays in the spool and is uploaded again, once, later)."""
        deadline = time.monotonic() + timeout
        self._closing = True
        self._wake.set()
        self._retry_now.set()
        while self.spool.backlog and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._abandon = True
        self._wake.set()
        self._retry_now.set()
        self._thread.join(timeout=0.5)
        return self.spool.backlog == 0

    # ---- the thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        delay = 1.0
        while not self._abandon:
            if self.spool.backlog == 0:
                if self._closing:
                    return
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            if self._try_upload():
                delay = 1.0
                continue
            # New records do not cut a back-off short (a step each would each try a dead
            # server); closing does, once.
            self._retry_now.wait(delay)
            self._retry_now.clear()
            delay = min(delay * 2, self.max_retry_s)

    def _try_upload(self) -> bool:
        try:
            return self._upload_some()
        except Exception as err:  # e.g. the cursor cannot be written: log, retry later
            log.error("tracking: the writer failed: %s", _short(err), exc_info=True)
            return False

    def _upload_some(self) -> bool:
        """Upload the next group of records; False on a failure worth retrying."""
        records, offsets = self.spool.read()
        for start, stop in _groups(records):
            if self._abandon:
                return True
            group = records[start:stop]
            try:
                upload(self.client, self.run_id, group)
            except Exception as err:  # any failure: the writer must outlive it
                if not _permanent(err):
                    self._on_outage(err)
                    return False
                log.error("tracking: MLflow refused %s, dropped: %s", _describe(group), err)
            self.spool.commit(offsets[stop - 1], len(group), max(map(_step, group)))
            self.uploaded += len(group)
            self._on_success()
        return True

    def _on_outage(self, err: Exception) -> None:
        if self.outage is None:  # one warning per outage, not one per retry
            log.warning(
                "tracking: MLflow at %s unreachable; %s, %d record(s) wait in %s and upload "
                "when it is back (%s)",
                self.client.tracking_uri,
                self.meanwhile,
                self.spool.backlog,
                self.spool.path,
                _short(err),
            )
        self.outage = _short(err)

    def _on_success(self) -> None:
        if self.outage is not None:
            self.outage = None
            log.info(
                "tracking: MLflow reachable again; uploading a backlog of %d record(s)",
                self.spool.backlog,
            )


def upload(client: MlflowClient, run_id: str, records: list[Record]) -> None:
    """Send `records` (one group: several metrics records, or one other record) to MLflow."""
    try:
        _send(client, run_id, records)
    except (KeyError, TypeError) as err:  # a field missing or of the wrong type
        raise BadRecord(f"damaged tracking record {str(records[0])[:200]}: {err!r}") from err


def _send(client: MlflowClient, run_id: str, records: list[Record]) -> None:
    op = records[0]["op"]
    if op == "metrics":
        metrics = [
            Metric(key, float(value), rec["ts"], rec["step"])
            for rec in records
            for key, value in rec["values"].items()
        ]
        for chunk in _chunks(metrics, _MAX_METRICS):  # a record may hold more than a call takes
            client.log_batch(run_id, metrics=chunk)
    elif op == "params":
        for chunk in _chunks(sorted(records[0]["values"].items()), _MAX_KEYS):
            client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
    elif op == "tags":
        for chunk in _chunks(sorted(records[0]["values"].items()), _MAX_KEYS):
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in chunk])
    elif op == "artifact":
        client.log_artifact(run_id, records[0]["path"], records[0].get("folder"))
    elif op == "text":
        client.log_text(run_id, records[0]["text"], records[0]["name"])
    elif op == "status":
        _upload_status(client, run_id, records[0])
    else:
        raise BadRecord(f"unknown tracking record {str(records[0])[:200]}")


def _upload_status(client: MlflowClient, run_id: str, record: Record) -> None:
    if record["status"] == "RUNNING":
        client.update_run(run_id, status="RUNNING")
    else:  # the end time the run ended at, also when uploaded by a later `mtprun sync`
        client.set_terminated(run_id, status=record["status"], end_time=record["ts"])


def _groups(records: list[Record]) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges: runs of metrics records up to _MAX_METRICS points, else one."""
    start = 0
    while start < len(records):
        stop = start + 1
        if records[start]["op"] == "metrics":
            points = len(records[start]["values"])
            while stop < len(records) and records[stop]["op"] == "metrics":
                points += len(records[stop]["values"])
                if points > _MAX_METRICS:
                    break
                stop += 1
        yield start, stop
        start = stop


class BadRecord(ValueError):
    """A spool record this writer cannot send (damaged, or from an unknown version)."""


def _permanent(err: Exception) -> bool:
    """A refusal that retrying cannot fix (a 4xx answer, a missing file, a damaged record),
    as opposed to an unreachable or failing server."""
    if isinstance(err, MlflowException):
        status = err.get_http_status_code()
        return 400 <= status < 500 and status not in (408, 429)
    return isinstance(err, FileNotFoundError | BadRecord)


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _step(record: Record) -> int:
    return int(record.get("step", 0)) if record["op"] == "metrics" else 0


def _describe(group: list[Record]) -> str:
    if group[0]["op"] == "metrics":
        return f"the metrics of steps {group[0]['step']}..{group[-1]['step']}"
    return f"a {group[0]['op']} record"


def _short(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."
