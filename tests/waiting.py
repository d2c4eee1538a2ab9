"""Waiting on a condition, not sleeping: the tests' one poll loop.

``wait_until(predicate, timeout_s, what)`` calls ``predicate`` until it returns something truthy and
returns that value; past the deadline it raises AssertionError naming ``what`` (and, given
``on_timeout``, that function's output, e.g. a log tail). An exception raised by ``predicate``
(an assertion that a process is still alive, a ChildExited) goes straight through: a predicate may
do work between checks (``group.check()``) and may fail early.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.05,
               on_timeout: Callable[[], object] | None = None) -> T:
    """``predicate()``'s first truthy value within ``timeout_s``; AssertionError naming ``what`` if none.

    The predicate is always asked once more after the deadline passed, so a slow last turn is not lost.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout_s:g} s waiting for {what}"
            if on_timeout is not None:
                message += f"\n{on_timeout()}"
            raise AssertionError(message)
        time.sleep(interval_s)
