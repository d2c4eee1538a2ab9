"""BackgroundCalls: one daemon thread that runs submitted calls in order, each answered by a Future.

For short I/O that a component overlaps with its own work: a bucket HEAD beside an encode, an anchor's
upload beside a delta's, a delta's download beside reading its manifest. Unlike a
``ThreadPoolExecutor``, the thread is a daemon (interpreter exit does not wait for a call stuck on an
unreachable endpoint) and it is started once: a thread started per call waits for the GIL before it
runs, which on a node busy generating took ~3 ms of each weight refresh.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_STOP = object()


class BackgroundCalls:
    """Calls run one at a time, in the order submitted, on a thread started by the first call."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Any] | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on the thread; its result or exception lands in the returned future."""
        future: Future[T] = Future()
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True).start()
            self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        """Let the thread end once the calls already submitted have run (a later submit starts a new one)."""
        with self._lock:
            if self._jobs is not None:
                self._jobs.put(_STOP)
                self._jobs = None


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while (job := jobs.get()) is not _STOP:
        fn, future = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)
