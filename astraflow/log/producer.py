"""LogProducer: Arrow tables and JSON control records onto topics, with claim checks and acked offsets."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Self

import pyarrow as pa

from astraflow.log.admin import open_kafka_client
from astraflow.log.claim_check import ClaimCheck
from astraflow.log.codec import ARROW_STREAM, JSON, ArrowCodec, RecordMeta, max_record_bytes
from astraflow.log.errors import LogError, ProduceRefusedError
from astraflow.log.lag import OffsetLedger
from astraflow.log.message import Ack
from astraflow.log.topics import validate_topic_name

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore


RETRYING_PRODUCER: dict[str, Any] = {"enable_idempotence": False, "max_in_flight_requests_per_connection": 1}
"""kafka-python settings of every AstraFlow producer. Its idempotent producer (the default) turns a
broker's UnknownError — what Tansu answers while its storage bucket restarts — into a fatal state that
fails every later send. AstraFlow is at-least-once with consumers that drop duplicates by identity, so a
plain producer that keeps retrying is the right one; one request in flight keeps each partition's order
across retries."""


class LogProducer:
    """Writes records per docs/record-format.md. A record is *acknowledged* when its future resolves:
    every in-sync replica has it (``acks="all"``), and :attr:`ledger` holds its offset."""

    def __init__(
        self,
        cfg: ClusterConfig,
        producer_id: str,
        *,
        linger_ms: int = 5,
        batch_size: int = 512 * 1024,
        compression_type: str | None = None,
        bootstrap_timeout_s: float = 10.0,
        store: ObjectStore | None = None,
        **kafka_overrides: Any,
    ) -> None:
        """``compression_type`` is None by default: Arrow token/float buffers compress poorly and CPU
        is the scarce resource; Tansu accepts ``gzip`` and ``zstd`` (kafka-python here lacks snappy/lz4).
        ``kafka_overrides`` go straight to ``KafkaProducer``."""
        from kafka import KafkaProducer

        self.cfg = cfg
        self.producer_id = producer_id
        self.ledger = OffsetLedger()
        self.codec = ArrowCodec()
        self._claims = ClaimCheck(cfg, store)
        kwargs = {
            "client_id": producer_id,
            "acks": "all",
            "linger_ms": linger_ms,
            "batch_size": batch_size,
            "compression_type": compression_type,
            "max_request_size": max_record_bytes(cfg.inline_limit_bytes),
            **RETRYING_PRODUCER,
        }
        kwargs.update(kafka_overrides)
        self._producer = open_kafka_client(KafkaProducer, f"producer {producer_id}", cfg, bootstrap_timeout_s,
                                           **kwargs)

    # -- sending ---------------------------------------------------------------------------------
    def send_table(
        self,
        topic: str,
        key: str | None,
        table: pa.Table | pa.RecordBatch,
        schema_name: str,
        schema_version: int,
        policy: str | None = None,
    ) -> Future[Ack]:
        """Send ``table`` as one Arrow IPC stream; a value above the inline limit goes to the bucket."""
        return self._send(topic, key, self.codec.encode_table(table), ARROW_STREAM, schema_name, schema_version, policy)

    def send_json(
        self,
        topic: str,
        key: str | None,
        obj: Any,
        schema_name: str = "json",
        schema_version: int = 1,
        policy: str | None = None,
    ) -> Future[Ack]:
        """Send a small control record (weight announcement, metrics) as a JSON document."""
        return self._send(topic, key, self.codec.encode_json(obj), JSON, schema_name, schema_version, policy)

    def _send(
        self,
        topic: str,
        key: str | None,
        value: bytes | memoryview,
        content_type: str,
        schema_name: str,
        schema_version: int,
        policy: str | None,
    ) -> Future[Ack]:
        from kafka.errors import KafkaError

        validate_topic_name(topic)
        size = len(value)
        claim_key = digest = None
        if size > self.cfg.inline_limit_bytes:
            claim_key, digest = self._claims.put(value)
            value = b""
        meta = RecordMeta(
            schema_name=schema_name,
            schema_version=int(schema_version),
            producer=self.producer_id,
            content_type=content_type,
            policy=policy,
            claim_key=claim_key,
            claim_sha256=digest,
            claim_size=size if claim_key else None,
        )
        result: Future[Ack] = Future()
        try:
            sent = self._producer.send(
                topic,
                value=value,
                key=None if key is None else key.encode(),
                headers=meta.to_headers(),
            )
        except KafkaError as exc:
            raise LogError(f"producer {self.producer_id}: cannot send to {topic}: {exc}") from exc

        def on_ack(md: Any) -> None:
            self.ledger.record(md.topic, md.partition, md.offset)
            result.set_result(Ack(md.topic, md.partition, md.offset, size, claim_key))

        def on_error(exc: BaseException) -> None:
            result.set_exception(ProduceRefusedError(f"producer {self.producer_id}: {topic} did not acknowledge: {exc}"))

        sent.add_callback(on_ack)
        sent.add_errback(on_error)
        return result

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every record sent so far is acknowledged or failed."""
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
