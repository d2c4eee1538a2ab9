"""LogProducer: Arrow tables and JSON control records onto topics, with claim checks and acked offsets."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

import pyarrow as pa

from astraflow.log.ack import AckFuture
from astraflow.log.admin import CLIENT_METRICS_OFF, open_kafka_client
from astraflow.log.claim_check import ClaimCheck
from astraflow.log.codec import ARROW_STREAM, JSON, ArrowCodec, RecordMeta, max_record_bytes
from astraflow.log.errors import LogError
from astraflow.log.lag import OffsetLedger
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


def key_partition(key: str, partitions: int) -> int:
    """The partition :class:`LogProducer` (kafka-python's default partitioner) sends a record keyed
    ``key`` to, on a topic of ``partitions`` partitions: murmur2 of the key's UTF-8 bytes."""
    from kafka.partitioner.default import murmur2

    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def record_policy(policies: Iterable[str]) -> str | None:
    """The ``policy`` header of a record whose rows name ``policies``: the one policy they all name; None
    when they name several, or only "" (tasks whose workflow picks the policy)."""
    named = set(policies)
    return (next(iter(named)) or None) if len(named) == 1 else None


class LogProducer:
    """Writes records per docs/record-format.md. A record is *acknowledged* when its
    :class:`~astraflow.log.ack.AckFuture` resolves: every in-sync replica has it (``acks="all"``). The
    :attr:`ledger` counts acknowledged records in the order sent, up to the first still in flight."""

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
        self._ledger = OffsetLedger()
        self._unrecorded: deque[Any] = deque()
        """kafka-python futures of the records sent and not yet in the ledger, in the order sent."""
        self._unrecorded_lock = threading.Lock()
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
            **CLIENT_METRICS_OFF,
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
    ) -> AckFuture:
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
    ) -> AckFuture:
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
    ) -> AckFuture:
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
        try:
            sent = self._producer.send(
                topic,
                value=value,
                key=None if key is None else key.encode(),
                headers=meta.to_headers(),
            )
        except KafkaError as exc:
            raise LogError(f"producer {self.producer_id}: cannot send to {topic}: {exc}") from exc
        with self._unrecorded_lock:
            self._unrecorded.append(sent)
        self._record_acked()
        return AckFuture(sent, self.producer_id, topic, size, claim_key)

    # -- the ledger ------------------------------------------------------------------------------
    @property
    def ledger(self) -> OffsetLedger:
        """End offset and count of the acknowledged records per partition (see the class docstring)."""
        self._record_acked()
        return self._ledger

    def _record_acked(self) -> None:
        # Read from kafka-python's futures on the caller's thread: a callback per record on the
        # producer's network thread costs throughput (astraflow/log/ack.py).
        with self._unrecorded_lock:
            while self._unrecorded and self._unrecorded[0].is_done:
                sent = self._unrecorded.popleft()
                if sent.succeeded():
                    self._ledger.record(sent.value.topic, sent.value.partition, sent.value.offset)

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
