"""One dependency (the broker, the bucket) gone away: one log line per backoff step, not a flood.

Why: every component is a long-lived client of Kafka and S3. When one of them goes away (a broker
restart, the stack stopped under a node started by hand), the libraries report each failed attempt
— kafka-python about 25 lines a second, each S3 call a traceback — which buries what a user needs:
*which* endpoint is gone, since when, and that the component is waiting for it. An
:class:`OutageReport` turns a stream of failures into a line at 0, 1, 2, 4, … (capped) seconds
into the outage, each naming the endpoint, and one line when it answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class OutageReport:
    """Failures and recoveries of one endpoint, reported on a backoff schedule.

    :meth:`failed` returns how long a caller that drives its own retries should wait before the
    next attempt (the current backoff step); callers whose library retries by itself (kafka-python)
    just ignore it. Thread-safe: kafka-python logs from its IO thread.
    """

    def __init__(self, what: str, endpoint: str, logger: logging.Logger, *, first_backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.endpoint = endpoint
        self.log = logger
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.since: float | None = None
        """When the current outage began; None while the endpoint answers."""
        self.failures = 0
        """Failures since the last line reported."""
        self._backoff = first_backoff_s
        self._next_report = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, error: BaseException | str) -> float:
        """Record a failure; log a line if this one opens the outage or a backoff step has passed.
        Returns the seconds to wait before retrying."""
        with self._lock:
            now = self.clock()
            self.failures += 1
            if self.since is None:
                self.since, self._backoff = now, self.first_backoff_s
                self.log.warning("%s %s unreachable: %s; retrying, next report in %.0f s", self.what,
                                 self.endpoint, _one_line(error), self._backoff)
                self._next_report, self.failures = now + self._backoff, 0
            elif now >= self._next_report:
                self._backoff = min(self._backoff * 2, self.max_backoff_s)
                self.log.warning("%s %s still unreachable after %.0f s (%d failed attempts since the last "
                                 "report; last: %s); next report in %.0f s", self.what, self.endpoint,
                                 now - self.since, self.failures, _one_line(error), self._backoff)
                self._next_report, self.failures = now + self._backoff, 0
            return self._backoff

    def ok(self) -> None:
        """The endpoint answered: close the outage with one line (nothing if there was none)."""
        with self._lock:
            if self.since is None:
                return
            self.log.warning("%s %s answers again after %.0f s", self.what, self.endpoint, self.clock() - self.since)
            self.since, self.failures = None, 0


def _one_line(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        text = str(error).splitlines()[0] if str(error) else ""
        return f"{type(error).__name__}: {text[:240]}" if text else type(error).__name__
    return error.splitlines()[0][:240] if error else "?"


OUTAGE_DEADLINE_S = 300.0
"""How long a component waits for the bucket before an operation fails as if nobody waited."""


def wait_out_outage(fn: Callable[[], T], report: OutageReport, *, deadline_s: float = OUTAGE_DEADLINE_S,
                    stop: threading.Event | None = None, max_retry_s: float = 2.0) -> T:
    """``fn()``, retried while the bucket is unreachable (:class:`ObjectStoreUnavailableError`:
    connection refused, timeouts, 5xx), with ``report``'s lines on its backoff schedule and one
    "answers again" line when it succeeds after failing. ``fn`` must be safe to call again (an
    idempotent put). Any other error is raised at once; the unavailable error itself is raised once
    ``deadline_s`` has passed since the first failure, or as soon as ``stop`` is set. Attempts come
    at the report's backoff, at most ``max_retry_s`` apart, so the caller resumes soon after the
    endpoint returns."""
    from astraflow.objstore.errors import ObjectStoreUnavailableError

    give_up: float | None = None
    while True:
        try:
            result = fn()
        except ObjectStoreUnavailableError as exc:
            now = report.clock()
            if give_up is None:
                give_up = now + deadline_s
            if now >= give_up or (stop is not None and stop.is_set()):
                if now >= give_up:
                    report.log.error("%s %s: giving up after %.0f s: %s", report.what, report.endpoint,
                                     deadline_s, _one_line(exc))
                raise
            wait = min(report.failed(exc), max_retry_s, max(0.0, give_up - now))
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)
            continue
        report.ok()
        return result
