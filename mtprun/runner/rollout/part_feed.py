"""A weight load fed over several calls: the parts of a colocated sync reach an engine one call
at a time (the trainer packs a part, the engine copies it, the trainer frees it and packs the
next), while vLLM's in-place reload reads all of them from one iterator in one call.

`PartFeed(load, streamed=True)` runs `load(iterator)` on a thread of its own; each `feed(part)`
hands one part to that iterator and returns once the load has read every tensor of it, so no
more than one part waits in the engine. `streamed=False` collects the parts and runs
`load(list)` at `finish` instead: for the readers that go over the tensors twice (LoRA's
adapter install, an MTP drafter reloaded from the policy's tensors).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

Named = list[tuple[str, torch.Tensor]]

_END = object()  # the last part was fed: the iterator stops
_ABORT = object()  # the update was given up: the iterator raises


class UpdateAborted(RuntimeError):
    """Raised inside the load when its feed was aborted before the last part."""


class PartFeed:
    """`load` fed part by part: `feed` each part, then `finish` (or `abort`)."""

    def __init__(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any], streamed: bool):
        self._load = load
        self.streamed = streamed
        self._collected: Named = []
        self._error: BaseException | None = None
        self._ended = False  # the load returned or raised
        if streamed:
            self._parts: queue.Queue[Any] = queue.Queue(maxsize=1)
            self._taken: queue.Queue[bool] = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="weight-load", daemon=True)
            self._thread.start()

    def feed(self, part: Named) -> None:
        """Hand `part` to the load; returns once it has read all of it (streamed)."""
        if not self.streamed:
            self._collected.extend(part)
            return
        if self._ended:  # nothing would read it
            raise self._failure()
        self._parts.put(part)  # the queue is empty: the previous feed's part was taken
        if not self._taken.get():  # the load ended before taking this part
            raise self._failure()

    def finish(self) -> None:
        """The last part was fed: let the load end and wait for it; re-raises its error."""
        if not self.streamed:
            self._load(self._collected)
            self._collected = []
            return
        self._end(_END)
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Give the update up: the load sees an error at its next read and ends."""
        if self.streamed:
            self._end(_ABORT)
        self._collected = []

    def _end(self, marker: object) -> None:
        with contextlib.suppress(queue.Full):  # full only when the load ended on its own
            self._parts.put_nowait(marker)
        self._thread.join()

    def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            part = self._parts.get()
            if part is _END:
                return
            if part is _ABORT:
                raise UpdateAborted("the weight update was aborted before its last part")
            yield from part
            del part  # read: its tensors are the load's now, or freed
            self._taken.put(True)

    def _run(self) -> None:
        try:
            self._load(self._stream())
        except BaseException as err:  # handed to the caller's thread
            self._error = err
        finally:
            self._ended = True
            self._taken.put(False)  # a feed waiting now learns the load ended

    def _failure(self) -> BaseException:
        """The load's own error, or that it ended without it."""
        if self._error is not None:
            return self._error
        return RuntimeError("the weight load ended before it took every part fed to it")
