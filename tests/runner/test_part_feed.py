"""A weight load fed over several calls (`PartFeed`): each feed returns once the load has read
all of its part, the load's own error reaches the caller, and an abort ends the load."""

from __future__ import annotations

import threading

import pytest
import torch

from mtprun.runner.rollout.part_feed import PartFeed, UpdateAborted


def _parts(sizes: list[int]) -> list[list[tuple[str, torch.Tensor]]]:
    parts, count = [], 0
    for size in sizes:
        parts.append([(f"w{count + i}", torch.randn(3)) for i in range(size)])
        count += size
    return parts


class Recorder:
    """A load that records the name of each tensor it reads, and the thread it ran on."""

    def __init__(self, fail_at: str | None = None) -> None:
        self.read: list[str] = []
        self.thread: threading.Thread | None = None
        self.fail_at = fail_at

    def __call__(self, named) -> None:
        self.thread = threading.current_thread()
        for name, _ in named:
            if name == self.fail_at:
                raise ValueError(f"no parameter {name}")
            self.read.append(name)


@pytest.mark.parametrize("sizes", [[1], [3, 1, 2], [2, 0, 4]])
def test_each_feed_returns_once_its_part_is_read(sizes):
    load = Recorder()
    feed = PartFeed(load, streamed=True)
    fed: list[str] = []
    for part in _parts(sizes):
        feed.feed(part)
        fed += [name for name, _ in part]
        assert load.read == fed  # all of it, and nothing yet of the next
    feed.finish()
    assert load.read == fed
    assert load.thread is not threading.current_thread()


def test_collected_parts_are_loaded_once_at_the_end():
    load = Recorder()
    feed = PartFeed(load, streamed=False)
    parts = _parts([2, 3])
    for part in parts:
        feed.feed(part)
        assert load.read == []
    feed.finish()
    assert load.read == [name for part in parts for name, _ in part]


def test_the_loads_error_reaches_the_feed_and_the_finish():
    parts = _parts([2, 2, 2])
    feed = PartFeed(Recorder(fail_at="w3"), streamed=True)
    feed.feed(parts[0])
    with pytest.raises(ValueError, match="no parameter w3"):
        feed.feed(parts[1])
    with pytest.raises(ValueError, match="no parameter w3"):
        feed.feed(parts[2])  # the load has ended: nothing waits for a reader forever
    with pytest.raises(ValueError, match="no parameter w3"):
        feed.finish()


def test_an_abort_ends_the_load_with_an_error_it_sees():
    seen: list[BaseException] = []

    def load(named) -> None:
        try:
            for _ in named:
                pass
        except UpdateAborted as err:
            seen.append(err)
            raise

    feed = PartFeed(load, streamed=True)
    feed.feed(_parts([2])[0])
    feed.abort()
    assert len(seen) == 1 and "aborted" in str(seen[0])
