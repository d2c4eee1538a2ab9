"""The embedded stack a run started, supervised like the run's components.

When ``astraflow run`` started the broker (Tansu) and the S3 server (SeaweedFS) itself, they are part
of the run: a server that dies is started again on the same ports and log storage, after the same
backoff and within the same budget as a component (:class:`RestartPolicy`), and an exhausted budget
fails the run naming it. With the durable log (``s3``) the records survive a broker restart; with
``memory`` they do not, and the run's topics are only re-created empty.

A stack the run did not start (``astraflow up``, external endpoints) is not the launcher's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from astraflow.launcher.restarts import RestartBook, RestartPolicy
from astraflow.launcher.supervisor import ChildExited, RestartEvent, note_restart

if TYPE_CHECKING:
    from astraflow.embedded import EmbeddedStack
    from astraflow.embedded.supervisor import SupervisedProcess


class StackWatch:
    """Restart bookkeeping for the servers of one owned :class:`EmbeddedStack`. Not thread-safe:
    driven from the launcher's loop, like :class:`~astraflow.launcher.supervisor.ProcessGroup`."""

    def __init__(self, stack: EmbeddedStack, policy: RestartPolicy,
                 on_broker_restart: Callable[[], None] | None = None) -> None:
        self.stack = stack
        self.policy = policy
        self.on_broker_restart = on_broker_restart
        """Called after Tansu is back (the launcher re-creates the run's topics: a no-op with the
        durable log, needed with the in-memory one)."""
        self.books = {p.name: RestartBook(policy) for p in self._servers()}
        self._due: dict[str, tuple[float, float]] = {}
        """Dead servers waiting out their backoff: name -> (restart time, backoff)."""

    def _servers(self) -> tuple[SupervisedProcess, ...]:
        # S3 first: the durable log lives in it; a secured stack's TLS terminator before the broker,
        # whose clients come through it.
        if self.stack.secure:
            return (self.stack.s3, self.stack.tls, self.stack.kafka)
        return (self.stack.s3, self.stack.kafka)

    def check(self, now: float | None = None) -> list[RestartEvent]:
        """Notice dead servers, restart those whose backoff is over (blocking until they answer).
        Raises :class:`ChildExited` when a server's restart budget is exhausted."""
        now = time.monotonic() if now is None else now
        events = []
        for proc in self._servers():
            if proc.name not in self._due:
                if proc.alive():
                    continue
                self._schedule(proc, now)
            at, backoff = self._due[proc.name]
            if now < at:
                continue
            del self._due[proc.name]
            try:
                self.stack.start_service(proc.name)
            except RuntimeError:  # died again during start-up, or never answered: one more death
                proc.stop(timeout_s=5.0)
                self._schedule(proc, time.monotonic())
                continue
            if proc.name == self.stack.kafka.name and self.on_broker_restart is not None:
                self.on_broker_restart()
            events.append(RestartEvent(proc.name, None, self.books[proc.name].restarts, backoff, proc.pid() or 0))
        return events

    def _schedule(self, proc: SupervisedProcess, now: float) -> None:
        book = self.books[proc.name]
        delay = book.on_exit(now)
        if delay is None:
            raise ChildExited(proc.name, None, proc.log_file, proc.log_tail(), restarts=book.restarts,
                              policy=self.policy)
        self._due[proc.name] = (now + delay, delay)
        note_restart(proc.log_file, proc.name, None, book.restarts, delay)

    def restarts(self) -> dict[str, int]:
        """Restarts so far per server that was restarted at least once."""
        return {name: b.restarts for name, b in self.books.items() if b.restarts}
