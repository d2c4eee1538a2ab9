"""What :meth:`LogConsumer.poll` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa


@dataclass
class Message:
    """One decoded record. ``table`` is set for Arrow records, ``obj`` for JSON records.

    Records read from the dead-letter topic are not decoded: ``value`` holds the original bytes and
    ``headers`` the original headers plus the ``dead-letter-*`` ones.
    """

    topic: str
    partition: int
    offset: int
    key: str | None
    headers: dict[str, str]
    schema_name: str | None = None
    schema_version: int | None = None
    producer: str | None = None
    policy: str | None = None
    table: pa.Table | None = None
    obj: Any = None
    record: Any = None
    """The JSON document as its typed record, parsed once at decode by the check registered for its
    schema (a control record's model, :mod:`astraflow.records.control`); None for other records."""
    value: bytes | None = None
    value_bytes: int = 0
    """Size of the payload (the claim's size for a claim-checked record)."""
    claim_key: str | None = None
    timestamp_ms: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ack:
    """A record the broker acknowledged (acks=all): where it landed."""

    topic: str
    partition: int
    offset: int
    value_bytes: int
    claim_key: str | None = None
