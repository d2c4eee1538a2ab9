"""Retry a broker request through transient errors, up to a deadline.

Why: a broker that just started (``astraflow up``), is electing a controller, or is briefly
overloaded answers with timeouts, ``NotController`` or ``LeaderNotAvailable`` for a few seconds; a
run must not fail on the first such answer. Errors a broker cannot fix by waiting (an invalid
config, a refused authorisation, a bad topic name) fail at once. Each retry logs one line naming
the endpoint, so a slow start is visible without flooding the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from astraflow.log.errors import BrokerUnavailableError, LogError, TransientBrokerError

T = TypeVar("T")
DEFAULT_DEADLINE_S = 60.0
"""How long a component keeps retrying a transient broker error before it gives up."""

log = logging.getLogger(__name__)


def is_transient(exc: BaseException) -> bool:
    """True for errors that waiting may cure: no broker (yet), timeouts, leadership moving, and
    every kafka-python error marked ``retriable``."""
    from kafka.errors import BrokerNotAvailableError, KafkaConfigurationError, KafkaError

    if isinstance(exc, (BrokerUnavailableError, TransientBrokerError, BrokerNotAvailableError)):
        return True
    if isinstance(exc, KafkaConfigurationError):
        return False
    return isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False))


def retry_transient(
    attempt: Callable[[float], T],
    *,
    what: str,
    endpoint: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
    attempt_timeout_s: float = 10.0,
    first_backoff_s: float = 0.5,
    max_backoff_s: float = 5.0,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> T:
    """``attempt(timeout_s)`` until it returns, raises a non-transient error (propagated at once), or
    ``deadline_s`` has passed (the last transient error is raised as a :class:`LogError` naming
    ``what``, ``endpoint`` and the number of attempts). Each attempt gets at most
    ``attempt_timeout_s`` and never more than what is left of the deadline (at least 1 s).
    ``sleep``/``clock`` default to :func:`time.sleep`/:func:`time.monotonic` (tests pass fakes)."""
    sleep = sleep or time.sleep
    clock = clock or time.monotonic
    start = clock()
    backoff = first_backoff_s
    attempts = 0
    while True:
        attempts += 1
        left = deadline_s - (clock() - start)
        try:
            return attempt(max(1.0, min(attempt_timeout_s, left)))
        except Exception as exc:
            if not is_transient(exc):
                raise
            left = deadline_s - (clock() - start)
            if left <= 0:
                cls = BrokerUnavailableError if isinstance(exc, BrokerUnavailableError) else LogError
                raise cls(f"{what} on {endpoint}: still failing after {attempts} attempts in {deadline_s:g} s "
                          f"({type(exc).__name__}: {exc})") from None
            wait = min(backoff, left)
            log.warning("%s on %s: %s (attempt %d); retrying in %.1f s, giving up in %.0f s",
                        what, endpoint, _one_line(exc), attempts, wait, left)
            sleep(wait)
            backoff = min(backoff * 2, max_backoff_s)


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
