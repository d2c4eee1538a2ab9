"""kafka-python's own log lines, summarised: an outage of the broker is a few clear lines, not 25/s.

Why: kafka-python reconnects by itself, and logs every failed attempt of every connection (socket
disconnected, abort, connection lost, fetch failed, coordinator lookup failed, …) at ERROR: a
component whose broker went away printed about 90 lines in its first second. Those lines say the
same thing — the broker at the bootstrap address does not answer — so they feed one
:class:`~astraflow.outage.OutageReport` (one line per backoff step, naming the endpoint, and one
when a connection succeeds again). Other kafka-python warnings pass, at most one per message
template per ``repeat_s``; CRITICAL always passes.
"""

from __future__ import annotations

import logging
import time

from astraflow.outage import OutageReport

log = logging.getLogger("astraflow.log.broker")

CONNECTION_MARKERS = ("KafkaConnectionError", "ECONNREFUSED", "socket disconnected", "Connection lost",
                      "Connection failed", "Bootstrap", "NodeNotReady", "timed out", "KafkaTimeoutError",
                      "Unable to connect", "Abort (", "No node available", "Error receiving network data",
                      "Error sending", "Connection reset")
"""Substrings of kafka-python messages that mean "the broker did not answer"."""


def _is_connection_trouble(record: logging.LogRecord, message: str) -> bool:
    """True when the record says the broker did not answer: a known message, or a traceback of a socket
    error (kafka-python logs ``ConnectionResetError`` with its whole stack, five lines each time)."""
    if any(marker in message for marker in CONNECTION_MARKERS):
        return True
    error = record.exc_info[1] if record.exc_info else None
    return isinstance(error, (OSError, TimeoutError))


class KafkaClientLogs(logging.Filter):
    """A handler filter: swallows kafka-python's records, reporting broker outages instead."""

    def __init__(self, bootstrap: str, *, repeat_s: float = 30.0) -> None:
        super().__init__()
        self.report = OutageReport("Kafka broker", bootstrap, log)
        self.repeat_s = repeat_s
        self._last_seen: dict[tuple[str, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "kafka" and not record.name.startswith("kafka."):
            return True
        if record.levelno >= logging.CRITICAL:
            return True
        decided = getattr(record, "_astraflow_pass", None)
        if decided is None:  # not seen through another handler yet
            decided = record._astraflow_pass = self._decide(record)
        return decided

    def _decide(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            if _is_connection_trouble(record, message):
                self.report.failed(message)
                return False
            return self._first_in_a_while(record)
        if message.endswith(": Connected") and self.report.down:
            self.report.ok()
        return False

    def _first_in_a_while(self, record: logging.LogRecord) -> bool:
        key, now = (record.name, record.msg), time.monotonic()
        if now - self._last_seen.get(key, -self.repeat_s) < self.repeat_s:
            return False
        self._last_seen[key] = now
        return True


def summarise_kafka_logs(bootstrap: str, handlers: list[logging.Handler] | None = None) -> KafkaClientLogs:
    """Install :class:`KafkaClientLogs` on ``handlers`` (default: the root logger's) and let
    kafka-python's INFO records through to it (it needs "Connected" to see a broker come back;
    none of them is printed)."""
    flt = KafkaClientLogs(bootstrap)
    for handler in handlers if handlers is not None else logging.getLogger().handlers:
        handler.addFilter(flt)
    logging.getLogger("kafka").setLevel(logging.INFO)
    return flt
