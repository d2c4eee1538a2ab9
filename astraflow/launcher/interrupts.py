"""Ctrl+C and SIGTERM for the launcher: one clean stop, whatever the moment.

Both signals raise :class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread, so SIGTERM
(``timeout``, a container runtime, systemd) stops a run exactly as Ctrl+C does. Only the first one
does: from then on, and inside :meth:`InterruptGuard.shielded` blocks (the stop itself), further
signals are ignored, so a second Ctrl+C cannot break a half-done stop and leave processes behind or
print a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the launcher: stop everything, exit status 130."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def signal_name(exc: BaseException) -> str:
    """``SIGTERM`` for an :class:`Interrupted`, ``SIGINT`` for a plain ``KeyboardInterrupt``."""
    return signal.Signals(exc.signum).name if isinstance(exc, Interrupted) else "SIGINT"


@dataclass
class InterruptGuard:
    """The process's handler of SIGINT and SIGTERM while a run is launched or stopped."""

    received: int | None = None
    """The first signal received (later ones are ignored)."""
    _shields: int = 0

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None or self._shields:
            return  # already stopping
        self.received = signum
        raise Interrupted(signum)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Signals arriving inside this block are ignored: wrap every stop/cleanup path in it."""
        self._shields += 1
        try:
            yield
        finally:
            self._shields -= 1


_active: InterruptGuard | None = None


@contextlib.contextmanager
def interrupt_guard() -> Iterator[InterruptGuard]:
    """Install the guard for the block (nested blocks share the outer one); the previous handlers
    come back afterwards. Outside the main thread, where Python cannot set handlers, the guard
    exists but nothing is installed."""
    global _active
    if _active is not None:
        yield _active
        return
    guard = InterruptGuard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, guard.handle)
    _active = guard
    try:
        yield guard
    finally:
        _active = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
