"""One fetched Kafka record -> a :class:`~astraflow.log.message.Message`: headers checked against the
expected schema, a claim-checked payload fetched from the bucket, Arrow or JSON decoded.

Shared by the group consumer (:class:`~astraflow.log.consumer.LogConsumer`) and the partition range
reader (:mod:`astraflow.log.range_reader`), so both refuse the same records for the same reasons.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astraflow.log.claim_check import ClaimCheck
from astraflow.log.codec import ARROW_STREAM, ArrowCodec, ExpectedSchemas, RecordMeta, check_schema
from astraflow.log.errors import OversizedRecordError, PayloadError
from astraflow.log.message import Message

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore


class RecordDecoder:
    """Decodes kafka-python ``ConsumerRecord``s; :meth:`decode` raises
    :class:`~astraflow.log.errors.DecodeError` (with its reason) for a record it refuses."""

    def __init__(self, cfg: ClusterConfig, expected_schemas: ExpectedSchemas | None = None,
                 store: ObjectStore | None = None) -> None:
        self.cfg = cfg
        self.expected_schemas = dict(expected_schemas or {})
        self.codec = ArrowCodec()
        self.claims = ClaimCheck(cfg, store)

    def decode(self, record: Any) -> Message:
        meta = RecordMeta.from_headers(record.headers)
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
        msg = message_of(record)
        msg.schema_name, msg.schema_version = meta.schema_name, meta.schema_version
        msg.producer, msg.policy, msg.claim_key = meta.producer, meta.policy, meta.claim_key
        msg.value_bytes = len(payload)
        if meta.content_type == ARROW_STREAM:
            msg.table = decoded
        else:
            msg.obj = decoded
        return msg


def message_of(record: Any) -> Message:
    """A record's position, key, headers and timestamp, nothing decoded."""
    return Message(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=None if record.key is None else record.key.decode("utf-8", "replace"),
        headers={k: (v or b"").decode("utf-8", "replace") for k, v in (record.headers or [])},
        timestamp_ms=record.timestamp,
    )
