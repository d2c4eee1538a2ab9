"""Read partitions from saved offsets to their ends, outside any consumer group.

For a component that must see what was written since a point it saved: the dataflow, restarted,
reads back the task and batch records its lost life sent after its last state save
(:mod:`astraflow.dataflow.adoption`). A partition's end is the high watermark of the fetch responses,
as for :meth:`LogConsumer.caught_up <astraflow.log.consumer.LogConsumer.caught_up>` and the archiver,
and at least what ``ListOffsets`` answers at the start (Tansu's answer can fall short of the truth, see
:mod:`astraflow.log.lag`, so it is only a floor). A position that moves past records never handed out
is taken back to the first one owed. A start offset the log no longer has (records deleted, the topic
re-created) reads nothing from that partition: what sat there is not this reader's to guess.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astraflow.log.admin import CLIENT_METRICS_OFF, open_kafka_client
from astraflow.log.codec import ExpectedSchemas, max_record_bytes
from astraflow.log.decoder import RecordDecoder
from astraflow.log.errors import DecodeError
from astraflow.log.message import Message
from astraflow.log.offsets import Partition
from astraflow.log.retry import retry_transient

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

log = logging.getLogger(__name__)

FETCH_MAX_WAIT_MS = 100
"""The reader's fetch wait: an empty partition answers after it, so a read of partitions that hold
nothing new costs about this much."""


@dataclass
class RangeRead:
    """What :func:`read_to_end` got."""

    messages: list[Message] = field(default_factory=list)
    """Decoded records, in offset order per partition."""
    complete: bool = True
    """Every partition was read to its end within the time allowed."""
    refused: int = 0
    """Records that did not decode (skipped, logged)."""


def read_to_end(cfg: ClusterConfig, starts: Mapping[Partition, int], *,
                expected_schemas: ExpectedSchemas | None = None, timeout_s: float = 10.0) -> RangeRead:
    """Every record of each partition from ``starts[partition]`` to the partition's end, decoded.
    Gives up after ``timeout_s`` with what it read (``complete`` False); a broker that does not
    answer is retried within the usual deadline (:func:`~astraflow.log.retry.retry_transient`)."""
    if not starts:
        return RangeRead()

    def attempt(attempt_timeout_s: float) -> RangeRead:
        return _read(cfg, starts, RecordDecoder(cfg, expected_schemas), attempt_timeout_s, timeout_s)

    return retry_transient(attempt, what=f"reading {len(starts)} partitions to their ends",
                           endpoint=cfg.kafka.bootstrap)


def _read(cfg: ClusterConfig, starts: Mapping[Partition, int], decoder: RecordDecoder, connect_timeout_s: float,
          timeout_s: float) -> RangeRead:
    from kafka import KafkaConsumer, TopicPartition

    consumer = open_kafka_client(KafkaConsumer, "range reader", cfg, connect_timeout_s, group_id=None,
                                 enable_auto_commit=False, auto_offset_reset="latest",
                                 fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
                                 max_partition_fetch_bytes=max_record_bytes(cfg.inline_limit_bytes),
                                 **CLIENT_METRICS_OFF)
    out = RangeRead()
    try:
        left = {TopicPartition(t, p): o for (t, p), o in starts.items()}
        consumer.assign(list(left))
        for tp, offset in left.items():
            consumer.seek(tp, offset)
        # A second opinion on where each partition ends: Tansu's ListOffsets answer can be short of the
        # truth (astraflow.log.lag), never beyond it, so a partition is done only past both.
        listed = consumer.end_offsets(list(left))
        nxt = dict(left)  # the offset each partition is due to hand out next
        deadline = time.monotonic() + timeout_s
        while left:
            if time.monotonic() > deadline:
                out.complete = False
                log.warning("read %d records; %d partitions not read to their end within %g s: %s", len(out.messages),
                            len(left), timeout_s, sorted((tp.topic, tp.partition) for tp in left))
                break
            for tp, records in consumer.poll(timeout_ms=FETCH_MAX_WAIT_MS * 2).items():
                for record in records:
                    nxt[tp] = record.offset + 1
                    try:
                        out.messages.append(decoder.decode(record))
                    except DecodeError as exc:
                        out.refused += 1
                        log.warning("record %s/%d@%d skipped: %s", record.topic, record.partition, record.offset, exc)
            for tp in list(left):
                position = consumer.position(tp, timeout_ms=1000)
                if position is None:
                    continue
                if position > nxt[tp]:
                    # Moved past records it never handed out (an offset reset racing the seek): go back.
                    log.warning("%s/%d: position %d skipped from %d; reading from %d again", tp.topic, tp.partition,
                                position, nxt[tp], nxt[tp])
                    consumer.seek(tp, nxt[tp])
                    continue
                high = consumer.highwater(tp)
                if high is not None and position >= max(high, listed.get(tp) or 0):
                    del left[tp]
    finally:
        consumer.close()
    return out
