"""UntilAcked: JSON records that must not be lost, sent again when the broker refuses one.

A trainer's step record is the only record of its step (reports, the launcher's progress and
``benchmarks/chaos.py`` read them). Sent and forgotten, one was lost whenever the broker refused it:
Tansu answers produce requests with errors while its storage bucket restarts, and kafka-python fails
those records without retrying (``UnknownError`` is not retriable). A refused record is not in the log,
so sending it again adds no duplicate.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.log.ack import AckFuture
    from astraflow.log.producer import LogProducer

log = logging.getLogger(__name__)


class UntilAcked:
    """Sends through ``producer`` and keeps each record until the broker acknowledges it."""

    def __init__(self, producer: LogProducer) -> None:
        self.producer = producer
        self._pending: list[tuple[AckFuture, str, str, Any, dict[str, Any]]] = []
        self.resent = 0
        """Records sent again after a refusal, over this sender's life."""

    def send_json(self, topic: str, key: str, obj: Any, **headers: Any) -> None:
        """``headers``: :meth:`LogProducer.send_json`'s ``schema_name``, ``schema_version``, ``policy``."""
        self._pending.append((self.producer.send_json(topic, key, obj, **headers), topic, key, obj, headers))

    def resend_refused(self) -> int:
        """Send again each record refused so far and forget the acknowledged ones; returns how many
        are still unacknowledged."""
        pending = []
        for ack, topic, key, obj, headers in self._pending:
            if ack.done():
                refusal = ack.exception()
                if refusal is None:
                    continue
                self.resent += 1
                log.info("%s; sending it again", refusal)
                ack = self.producer.send_json(topic, key, obj, **headers)
            pending.append((ack, topic, key, obj, headers))
        self._pending = pending
        return len(pending)

    def settle(self, timeout_s: float) -> bool:
        """Wait until every record is acknowledged, sending refused ones again, for at most ``timeout_s``.
        False if some are still unacknowledged then."""
        deadline = time.monotonic() + timeout_s
        while self.resend_refused():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self._pending[0][0].exception(min(left, 0.2))
            except TimeoutError:
                pass
            if any(ack.done() and ack.exception() is not None for ack, *_ in self._pending):
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))  # a refusing broker: do not spin
        return True
