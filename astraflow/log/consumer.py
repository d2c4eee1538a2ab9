"""LogConsumer: decoded Messages from a consumer group, at-least-once, with dead letters and backpressure.

Offsets are committed only by :meth:`LogConsumer.commit`, only for records the caller says it
processed, and only up to the first record in delivery order that it has not processed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from astraflow.config import BACKGROUND_FETCH_MAX_WAIT_MS, KAFKA_FETCH_MAX_WAIT_MS
from astraflow.log.admin import CLIENT_METRICS_OFF, open_kafka_client
from astraflow.log.codec import ExpectedSchemas, max_record_bytes
from astraflow.log.dead_letters import DeadLetterPublisher
from astraflow.log.decoder import RecordDecoder, message_of
from astraflow.log.errors import DecodeError
from astraflow.log.handoff import HandoffLatency
from astraflow.log.message import Message
from astraflow.log.offsets import Partition, ProcessedOffsets

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore

_log = logging.getLogger(__name__)


AUTO_OFFSET_RESET = "earliest"
"""Where a group without a committed offset starts reading a partition: at its beginning, so nothing
produced before the group's first member joined is skipped (a KEDA trigger on the group says the same)."""


class LogConsumer:
    """One member of consumer group ``group_id`` on ``topics``.

    Call :meth:`poll` regularly even while paused: a member that does not poll within
    ``max_poll_interval_ms`` is dropped from the group and its partitions go to another member.
    """

    def __init__(
        self,
        cfg: ClusterConfig,
        topics: Sequence[str] | str,
        group_id: str,
        expected_schemas: ExpectedSchemas | None = None,
        *,
        session_timeout_ms: int = 6000,
        heartbeat_interval_ms: int = 1000,
        max_poll_interval_ms: int = 60_000,
        auto_offset_reset: str = AUTO_OFFSET_RESET,
        client_id: str | None = None,
        bootstrap_timeout_s: float = 10.0,
        store: ObjectStore | None = None,
        background: bool = False,
        start_at: Mapping[Partition, int] | None = None,
        **kafka_overrides: Any,
    ) -> None:
        """``session_timeout_ms=6000``: a group join takes ~3 s against Tansu (23 s at kafka-python's
        45 s default). ``max_poll_interval_ms``: longest gap between polls (one RL step) before the
        member is considered dead. ``background``: a consumer no hand-off waits on (an archive, a progress
        view); its fetches wait at least ``BACKGROUND_FETCH_MAX_WAIT_MS``, so it wakes less often.
        ``start_at``: (topic, partition) -> the offset to read from instead of the group's committed one,
        until this member commits on that partition (a trainer resuming from a checkpoint older than
        what its group committed: a rollback, or a corrupt newest checkpoint it fell back from).
        ``kafka_overrides`` go straight to ``KafkaConsumer``."""
        from kafka import ConsumerRebalanceListener, KafkaConsumer

        self.cfg = cfg
        self.group_id = group_id
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self._decoder = RecordDecoder(cfg, expected_schemas, store)
        self._dead_letters = DeadLetterPublisher(cfg, group_id)
        self._offsets = ProcessedOffsets()
        self._paused = False
        self._auto_offset_reset = auto_offset_reset
        self._revoked_before: set[Any] = set()
        self._reseek: set[Any] = set()
        self._start_at: dict[Partition, int] = dict(start_at or {})
        """Where to read a partition from until this member commits on it (``start_at``)."""
        self._unreachable_since = 0.0
        """Monotonic time the first poll of a broker outage failed (0: the broker answers)."""
        self.handoff = HandoffLatency()
        """Send -> poll milliseconds per topic, for the component's metrics records."""
        kwargs = {
            "group_id": group_id,
            "client_id": client_id or f"astraflow-{group_id}",
            "enable_auto_commit": False,
            "auto_offset_reset": auto_offset_reset,
            "session_timeout_ms": session_timeout_ms,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "max_poll_interval_ms": max_poll_interval_ms,
            "max_partition_fetch_bytes": max_record_bytes(cfg.inline_limit_bytes),
            "fetch_max_wait_ms": cfg.kafka.fetch_max_wait_ms or KAFKA_FETCH_MAX_WAIT_MS,
            **CLIENT_METRICS_OFF,
        }
        if background:
            kwargs["fetch_max_wait_ms"] = max(kwargs["fetch_max_wait_ms"], BACKGROUND_FETCH_MAX_WAIT_MS)
        kwargs.update(kafka_overrides)
        self._consumer = open_kafka_client(KafkaConsumer, f"consumer {group_id}", cfg, bootstrap_timeout_s,
                                           **kwargs)

        outer = self

        # kafka-python runs these on its IO thread, where blocking calls (commit, committed) are
        # refused: only record what changed; poll() acts on it in the caller's thread.
        class _Rebalance(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: Any) -> None:
                keys = {(tp.topic, tp.partition) for tp in revoked}
                outer._offsets.forget(keys)
                outer._revoked_before |= set(revoked)

            def on_partitions_assigned(self, assigned: Any) -> None:
                outer._reseek |= {tp for tp in assigned
                                  if tp in outer._revoked_before or (tp.topic, tp.partition) in outer._start_at}
                if outer._paused and assigned:
                    outer._consumer.pause(*assigned)

        self._consumer.subscribe(self.topics, listener=_Rebalance())

    # -- reading -----------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Message]:
        """Decoded records, in order per partition. Undecodable ones are dead-lettered (and count as
        processed) instead of being returned."""
        from kafka.errors import KafkaConnectionError

        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except KafkaConnectionError as exc:
            # The broker is restarting (kafka-python raises its coordinator lookup's connection error out
            # of poll). Nothing was delivered and no position moved: the caller's loop polls again, as it
            # would after an empty poll. A component that died here instead resumed from its last save.
            if not self._unreachable_since:
                self._unreachable_since = time.monotonic()
                _log.warning("consumer %s: broker unreachable (%s: %s); polling on until it answers",
                             self.group_id, type(exc).__name__, exc)
            time.sleep(min(timeout_s, 1.0))
            return []
        if self._unreachable_since:
            _log.warning("consumer %s: broker answers again after %.1f s", self.group_id,
                         time.monotonic() - self._unreachable_since)
            self._unreachable_since = 0.0
        if self._reseek:
            # A partition kept through a rebalance keeps kafka-python's fetch position, but its
            # processed-offset state was dropped on revoke: re-read it from the committed offset so
            # "commit only the processed prefix" stays true (in-flight records come again).
            # Only partitions already in the assignment are re-positioned now; one the IO thread
            # has announced but not yet installed waits for the next poll instead of being dropped.
            reseek = self._reseek & self._consumer.assignment()
            self._reseek -= reseek
            batches = {tp: records for tp, records in batches.items() if tp not in reseek}
            self._seek_to_committed(reseek)
        out: list[Message] = []
        try:
            for tp, records in batches.items():
                for record in records:
                    key = (tp.topic, tp.partition)
                    self._offsets.delivered(key, record.offset)
                    self.handoff.observe(record.topic, record.timestamp)
                    if record.topic == self._dead_letters.topic:
                        out.append(self._undecoded(record))
                        continue
                    try:
                        out.append(self._decoder.decode(record))
                    except DecodeError as exc:
                        self._dead_letters.publish(record, exc.reason, str(exc))
                        self._offsets.processed(key, record.offset)
        except BaseException:
            # Nothing of this poll reaches the caller: rewind so every record is fetched again.
            for tp, records in batches.items():
                if records:
                    self._offsets.undeliver((tp.topic, tp.partition), records[0].offset)
                    self._consumer.seek(tp, records[0].offset)
            raise
        return out

    def _undecoded(self, record: Any) -> Message:
        msg = message_of(record)
        msg.value = record.value
        msg.value_bytes = len(record.value or b"")
        return msg

    # -- committing --------------------------------------------------------------------------------
    def commit(self, messages: Iterable[Message] = ()) -> dict[Partition, int]:
        """Mark ``messages`` processed and commit, per partition, offset + 1 of the last record of the
        processed prefix (dead-lettered records count as processed). Returns what was committed;
        messages of partitions this member no longer owns are skipped (another member re-reads them)."""
        for m in messages:
            self._offsets.processed((m.topic, m.partition), m.offset)
        return self._commit_prefix(self._offsets.to_commit())

    def commit_pending(self, timeout_s: float = 5.0) -> bool:
        """Commit what is processed and not yet committed, retrying until ``timeout_s``: a component's
        last commit before it exits, when a failed commit has no next one to cover it (a rebalance
        still settling after a restart). Polls between tries so the group can settle; records those
        polls fetch are not handed out (the next life reads them from the committed offset)."""
        deadline = time.monotonic() + timeout_s
        while True:
            offsets = self._offsets.to_commit()
            if not offsets or self._commit_prefix(offsets):
                return True
            if time.monotonic() >= deadline:
                return False
            self._consumer.poll(timeout_ms=200, max_records=1, update_offsets=False)

    def _commit_prefix(self, offsets: dict[Partition, int]) -> dict[Partition, int]:
        from kafka import TopicPartition
        from kafka.errors import CommitFailedError, KafkaError
        from kafka.structs import OffsetAndMetadata

        if not offsets:
            return {}
        try:
            self._consumer.commit({TopicPartition(t, p): OffsetAndMetadata(o, "", -1)
                                   for (t, p), o in offsets.items()})
        except (CommitFailedError, KafkaError) as exc:
            if not (isinstance(exc, CommitFailedError) or getattr(exc, "retriable", False)
                    or type(exc).__name__ in ("KafkaConnectionError", "NoBrokersAvailable")):
                raise
            # A lost broker or a rebalance: the offsets stay pending and the next commit covers
            # them; at worst the records are delivered again (at-least-once), never lost.
            _log.warning("commit of %d partition(s) failed (%s: %s); will be retried with the next commit",
                         len(offsets), type(exc).__name__, exc)
            return {}
        self._offsets.committed(offsets)
        for tp in offsets:
            self._start_at.pop(tp, None)  # the group's committed offset is this member's own from now on
        return offsets

    def _seek_to_committed(self, partitions: Any) -> None:
        for tp in partitions:
            start = self._start_at.get((tp.topic, tp.partition))
            if start is not None:
                _log.info("consumer %s: reading %s:%d from offset %d (asked for), not from the group's "
                          "committed offset", self.group_id, tp.topic, tp.partition, start)
                self._consumer.seek(tp, start)
                continue
            committed = self._consumer.committed(tp)
            if committed is not None:
                self._consumer.seek(tp, committed)
            elif self._auto_offset_reset == "earliest":
                self._consumer.seek_to_beginning(tp)
        self._offsets.forget([(tp.topic, tp.partition) for tp in partitions])

    # -- backpressure ------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop fetching (keep polling: the member stays in the group). Survives rebalances."""
        self._paused = True
        assigned = self._consumer.assignment()
        if assigned:
            self._consumer.pause(*assigned)

    def resume(self) -> None:
        self._paused = False
        paused = self._consumer.paused()
        if paused:
            self._consumer.resume(*paused)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def assignment(self) -> set[Partition]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def caught_up(self) -> bool:
        """Whether this member holds partitions and has read each of them to its end as of the
        latest fetch response (position >= high watermark). False while it is still joining the
        group, while a position is being looked up, and before a partition's first fetch came back."""
        from kafka.errors import IllegalStateError

        assigned = self._consumer.assignment()
        if not assigned:
            return False
        try:
            for tp in assigned:
                high = self._consumer.highwater(tp)
                if high is None:
                    return False
                position = self._consumer.position(tp, timeout_ms=100)
                if position is None or position < high:
                    return False
        except IllegalStateError:  # revoked meanwhile
            return False
        return True

    def wait_for_assignment(self, timeout_s: float = 15.0) -> set[Partition]:
        """Poll (handing nothing out) until the group assigned partitions; returns them.

        Records fetched meanwhile are rewound, so nothing is skipped.
        """
        deadline = time.monotonic() + timeout_s
        while not self._consumer.assignment():
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {self.group_id} assigned no partition of {self.topics} in {timeout_s:g} s")
            batches = self._consumer.poll(timeout_ms=100, max_records=1)
            for tp, records in batches.items():
                if records:
                    self._consumer.seek(tp, records[0].offset)
        return self.assignment

    def close(self) -> None:
        """Leave the group without committing anything (uncommitted records will be re-read)."""
        try:
            self._consumer.close(autocommit=False)
        finally:
            self._dead_letters.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

