"""Dead letters: a record nobody can decode or validate is kept, byte for byte, with the reason.

The dead letter has the original key, value and headers, plus ``dead-letter-reason`` (a short tag),
``dead-letter-error`` (the message), ``dead-letter-source-topic``, ``-source-partition``,
``-source-offset`` and ``dead-letter-group``. It is published with acks=all and awaited before the
source offset counts as processed, so nothing is lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astraflow.log.admin import ensure_topics, open_kafka_client
from astraflow.log.codec import max_record_bytes
from astraflow.log.errors import LogError
from astraflow.log.producer import RETRYING_PRODUCER
from astraflow.log.topics import Topics

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

H_REASON = "dead-letter-reason"
H_ERROR = "dead-letter-error"
H_SOURCE_TOPIC = "dead-letter-source-topic"
H_SOURCE_PARTITION = "dead-letter-source-partition"
H_SOURCE_OFFSET = "dead-letter-source-offset"
H_GROUP = "dead-letter-group"
H_TRUNCATED = "dead-letter-truncated-from"
"""Present when the original value was too large to publish whole: its size in bytes (the dead letter
then keeps the first bytes that fit, so the record still lands, with its reason)."""


class DeadLetterPublisher:
    """Publishes undecodable records to ``<run>.dead-letters``; opens its producer on first use."""

    def __init__(self, cfg: ClusterConfig, group_id: str, timeout_s: float = 30.0) -> None:
        self.cfg = cfg
        self.group_id = group_id
        self.topic = Topics(cfg.run).dead_letters
        self.timeout_s = timeout_s
        self._producer: Any = None

    def _open(self) -> Any:
        if self._producer is None:
            from kafka import KafkaProducer

            ensure_topics(self.cfg, {self.topic: 1})
            # Opened like every other client: no broker -> BrokerUnavailableError naming the bootstrap.
            self._producer = open_kafka_client(
                KafkaProducer, f"dead-letter producer of {self.group_id}", self.cfg, self.timeout_s,
                client_id=f"astraflow-dead-letters-{self.group_id}",
                acks="all",
                **RETRYING_PRODUCER,
                # A dead letter is as large as the record that failed.
                max_request_size=max_record_bytes(self.cfg.inline_limit_bytes),
            )
        return self._producer

    def publish(self, record: Any, reason: str, error: str) -> tuple[int, int]:
        """Publish a kafka-python ``ConsumerRecord`` as a dead letter; return its (partition, offset)."""
        headers = list(record.headers or [])
        headers += [
            (H_REASON, reason.encode()),
            (H_ERROR, error.encode("utf-8", "replace")[:8192]),
            (H_SOURCE_TOPIC, record.topic.encode()),
            (H_SOURCE_PARTITION, str(record.partition).encode()),
            (H_SOURCE_OFFSET, str(record.offset).encode()),
            (H_GROUP, self.group_id.encode()),
        ]
        value = record.value
        room = max_record_bytes(self.cfg.inline_limit_bytes) - 64 * 1024  # headers and framing
        if value is not None and len(value) > room:
            headers.append((H_TRUNCATED, str(len(value)).encode()))
            value = bytes(value[:room])
        try:
            md = self._open().send(self.topic, key=record.key, value=value, headers=headers).get(
                timeout=self.timeout_s
            )
        except Exception as exc:
            raise LogError(
                f"could not dead-letter {record.topic}[{record.partition}]@{record.offset} ({reason}): {exc}"
            ) from exc
        return md.partition, md.offset

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=10)
            self._producer = None
