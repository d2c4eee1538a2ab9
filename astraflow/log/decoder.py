"""One fetched Kafka record -> a :class:`~astraflow.log.message.Message`: headers checked against the
expected schema, a claim-checked payload fetched from the bucket, Arrow or JSON decoded.

Shared by the group consumer (:class:`~astraflow.log.consumer.LogConsumer`) and the partition range
reader (:mod:`astraflow.log.range_reader`), so both refuse the same records for the same reasons.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astraflow.log.claim_check import ClaimCheck
from astraflow.log.codec import (
    ARROW_STREAM,
    ArrowCodec,
    ExpectedSchemas,
    RecordMeta,
    check_schema,
    checked_record,
)
from astraflow.log.errors import OversizedRecordError, PayloadError
from astraflow.log.message import Message

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore


HEADER_CACHE_SIZE = 256
"""Distinct header sets whose parse a decoder keeps. A stream's records mostly repeat one set (schema,
producer, content type, policy); parsing it costs ~3 us a record, ~5% of reading a 64 KiB record."""


class RecordDecoder:
    """Decodes kafka-python ``ConsumerRecord``s; :meth:`decode` raises
    :class:`~astraflow.log.errors.DecodeError` (with its reason) for a record it refuses."""

    def __init__(self, cfg: ClusterConfig, expected_schemas: ExpectedSchemas | None = None,
                 store: ObjectStore | None = None) -> None:
        self.cfg = cfg
        self.expected_schemas = dict(expected_schemas or {})
        self.codec = ArrowCodec()
        self.claims = ClaimCheck(cfg, store)
        self._parsed: dict[tuple, tuple[RecordMeta, dict[str, str]]] = {}

    def _headers(self, headers: Any) -> tuple[RecordMeta, dict[str, str]]:
        """The record's metadata and its headers as text, parsed once per distinct set."""
        key = tuple(headers or ())
        parsed = self._parsed.get(key)
        if parsed is None:
            parsed = RecordMeta.from_headers(headers), text_headers(headers)
            if len(self._parsed) >= HEADER_CACHE_SIZE:  # e.g. claim-checked records: each set is new
                self._parsed.clear()
            self._parsed[key] = parsed
        return parsed

    def decode(self, record: Any) -> Message:
        meta, headers = self._headers(record.headers)
        check_schema(meta, record.topic, self.expected_schemas)
        if meta.claim_key is not None:
            payload = self.claims.get(meta.claim_key, meta.claim_sha256 or "", meta.claim_size)
        elif record.value is None:
            raise PayloadError("record has no value (tombstone) and no claim")
        elif len(record.value) > self.cfg.inline_limit_bytes:
            raise OversizedRecordError(
                f"inline value of {len(record.value)} bytes is above the inline limit of "
                f"{self.cfg.inline_limit_bytes} bytes (a conforming producer claim-checks it)"
            )
        else:
            payload = record.value
        decoded = self.codec.decode(meta, payload)
        msg = message_of(record, dict(headers))
        msg.schema_name, msg.schema_version = meta.schema_name, meta.schema_version
        msg.producer, msg.policy, msg.claim_key = meta.producer, meta.policy, meta.claim_key
        msg.value_bytes = len(payload)
        if meta.content_type == ARROW_STREAM:
            msg.table = decoded
        else:
            msg.obj, msg.record = decoded, checked_record(meta, decoded)
        return msg


def message_of(record: Any, headers: dict[str, str] | None = None) -> Message:
    """A record's position, key, headers (``headers``: already as text) and timestamp, nothing decoded."""
    return Message(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=None if record.key is None else record.key.decode("utf-8", "replace"),
        headers=text_headers(record.headers) if headers is None else headers,
        timestamp_ms=record.timestamp,
    )


def text_headers(headers: Any) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", "replace") for k, v in (headers or [])}
