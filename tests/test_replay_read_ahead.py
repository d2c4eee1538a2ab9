"""The replay's read-ahead thread: items in order, the producer's error raised to the consumer, and the
thread gone soon after the consumer stops early."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from waiting import wait_until

from astraflow.archive.replay import read_ahead


def test_items_in_order_and_errors_reach_the_consumer():
    assert list(read_ahead(iter(range(100)), 2)) == list(range(100))

    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("bad part")

    got = read_ahead(failing(), 2)
    assert next(got) == 1
    with pytest.raises(ValueError, match="bad part"):
        next(got)


def test_thread_stops_when_the_consumer_does():
    items = read_ahead(iter(range(10_000)), 1)
    assert next(items) == 0
    items.close()
    wait_until(lambda: not any(t.name == "archive-read-ahead" for t in threading.enumerate()), 5,
               "the archive-read-ahead thread to end after its consumer closed")
