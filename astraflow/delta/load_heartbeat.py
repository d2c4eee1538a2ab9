"""A weight reader's record kept fresh while it loads, so that the weight GC keeps what it is reading.

The GC keeps, for every live subscriber, the versions after the one it holds; a subscriber is live while
its record's heartbeat is younger than ``subscriber_ttl_s`` (:mod:`astraflow.delta.retention`). A record
written only when a load ends protects nothing during the load: a node loading a large anchor and its
chain for longer than the TTL, or while the trainer publishes a newer anchor, could see the GC delete the
very objects it is reading (an ``ObjectNotFoundError`` and a load started again, or a failed one). So a
load says what it reads: the record carries ``loading`` (the first version of the plan; the GC keeps it
and everything after it) and is rewritten every ``every_s`` on a thread of its own until the load ends.
A full load (an anchor: the long kind) writes it at once; a load of deltas only (a node's refresh, the
hot path) writes it only if it is still running after ``every_s``, so a short refresh costs no PUT.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Self

log = logging.getLogger(__name__)

LOAD_HEARTBEAT_S = 30.0
"""How often a subscriber rewrites its record while a load runs: 20x inside the GC's default subscriber
TTL (600 s)."""


class LoadHeartbeat:
    """``with LoadHeartbeat(write, every_s, at_once=...):`` calls ``write()`` (at once when ``at_once``)
    and then every ``every_s`` on a daemon thread until the block ends. :attr:`wrote`: whether it did."""

    def __init__(self, write: Callable[[], None], every_s: float, *, at_once: bool, name: str) -> None:
        self._write, self.every_s, self.at_once, self.name = write, every_s, at_once, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wrote = False
        """Whether a record was written: the load's end must then write the plain record at once."""

    def _beat(self) -> None:
        if self.at_once:
            self._try_write()
        while not self._stop.wait(self.every_s):
            self._try_write()

    def _try_write(self) -> None:
        try:
            self._write()
            self.wrote = True
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat is retried at the next beat
            log.warning("%s: could not refresh its subscriber record while loading (%s: %s)", self.name,
                        type(exc).__name__, exc)

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._beat, name=f"load-heartbeat-{self.name}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
