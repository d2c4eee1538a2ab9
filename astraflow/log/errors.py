"""Errors raised by the log layer. Every one is a :class:`LogError`."""

from __future__ import annotations


class LogError(RuntimeError):
    """The log (Kafka) could not be reached, refused a request, or returned something unusable."""


class BrokerUnavailableError(LogError):
    """No broker answered at the configured bootstrap address within the timeout."""


class BrokerRefusedError(LogError):
    """The broker refused this client's connection for a cause waiting cannot cure (TLS: a client
    certificate it does not accept, a certificate the client does not trust, TLS on one side only)."""


class TransientBrokerError(LogError):
    """The broker answered with a retriable error (timeout, no controller or leader yet): waiting
    may cure it, so :func:`astraflow.log.retry.retry_transient` retries it within its deadline."""


class TopicNameError(LogError, ValueError):
    """A run id, pool or policy name would make an illegal or ambiguous Kafka topic name."""


class DecodeError(LogError):
    """A record cannot be turned into a table or object; it goes to the dead-letter topic.

    ``reason`` is a short machine-readable tag (``bad-arrow``, ``schema-mismatch``, ...) written
    into the dead letter's ``dead-letter-reason`` header next to the full message.
    """

    reason = "undecodable"


class MissingHeaderError(DecodeError):
    """A record lacks a header the format requires (``schema``, ``schema-version``, ...)."""

    reason = "missing-header"


class SchemaMismatchError(DecodeError):
    """A record's schema name or version is not the one the consumer expects."""

    reason = "schema-mismatch"


class PayloadError(DecodeError):
    """The value is not a valid Arrow IPC stream / JSON document."""

    reason = "bad-payload"


class OversizedRecordError(DecodeError):
    """An inline value above the run's inline limit: a conforming producer would have claim-checked it."""

    reason = "oversized"


class ClaimCheckError(DecodeError):
    """A claim-checked payload is missing from the bucket or does not match its sha256."""

    reason = "bad-claim"


class ProduceRefusedError(LogError):
    """The broker did not acknowledge a record. kafka-python's producer can stay failed after a fatal
    broker answer, so a component that must not lose the record restarts rather than carry on."""
