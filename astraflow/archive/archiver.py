"""The archiver: one consumer group over a run's topics, Parquet parts in the bucket, then commits.

Per (topic, partition) it buffers the decoded rows of a contiguous run of offsets and flushes them
when the buffer holds ``max_records`` records or ``max_bytes`` bytes, is ``flush_s`` old, or the
archiver stops. A flush uploads one part per (kind, policy) named after the topic, partition and
first offset of the buffer (:meth:`RunLayout.archive_part_key`), then commits the offsets. Encoding
and upload run on one background thread while the consumer reads on; commits stay on the consumer's
thread and in offset order, each after its part is in the bucket.

Recovery: a part that was uploaded but not committed is found again by its name when the buffer
restarts at the same first offset; its footer says its last offset, and the buffer then flushes at
exactly that offset, so the rewrite has the same names and the same rows (no duplicate, no gap).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.archive import rows as R
from astraflow.outage import OutageReport, wait_out_outage
from astraflow.records.schema import RecordSchemaError

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.log import Message
    from astraflow.objstore import ObjectStore

log = logging.getLogger(__name__)
PARQUET = "application/vnd.apache.parquet"
MAX_PENDING_UPLOADS = 4
"""Buffers handed to the upload thread and not yet committed, at most (memory bound)."""
_PART_RE = re.compile(r"/part-(?P<topic>.+)-(?P<partition>\d+)-(?P<first>\d{20})\.parquet$")


@dataclass
class _Buffer:
    topic: str
    partition: int
    first: int
    last: int
    started: float
    until: int | None = None
    """Flush exactly at this offset: an earlier life uploaded a part ending there."""
    messages: list[Message] = field(default_factory=list)
    rows: dict[tuple[str, str | None], list[R.Rows]] = field(default_factory=dict)
    nbytes: int = 0


@dataclass
class _Uploaded:
    keys: list[str] = field(default_factory=list)
    rows: Counter = field(default_factory=Counter)
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class ArchiveStats:
    records: int = 0
    rows: Counter = field(default_factory=Counter)
    """Rows uploaded per kind."""
    parts: int = 0
    bytes: int = 0
    skipped: int = 0
    """Records that broke their schema (counted, not archived; the dataflow refuses them too)."""
    flush_s: float = 0.0
    """Seconds the upload thread spent encoding and uploading parts."""

    def as_dict(self) -> dict[str, Any]:
        return {"records": self.records, "rows": dict(self.rows), "parts": self.parts, "bytes": self.bytes,
                "skipped": self.skipped, "flush_s": round(self.flush_s, 3)}


def _by_kind_and_policy(rows: dict[tuple[str, str | None], list[R.Rows]]) -> list[tuple[str, str | None, list]]:
    """(kind, policy, tables) per part to write, trajectory rows split by policy here (off the consuming
    thread)."""
    out: dict[tuple[str, str | None], list] = {}
    for (kind, policy), items in rows.items():
        finished = R.trajectory_parts(items) if kind == R.TRAJECTORIES and policy is None else items
        for r in finished:
            out.setdefault((r.kind, r.policy), []).append(r.table)
    return [(k, p, tables) for (k, p), tables in sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))]


class Archiver:
    """Archive run ``cfg.run``'s trajectories, batches and weights of ``policies``, and metrics."""

    def __init__(self, cfg: ClusterConfig, policies: list[str], *, store: ObjectStore | None = None,
                 group_id: str | None = None, max_records: int = 5000, max_bytes: int = 64 * 1024 * 1024,
                 flush_s: float = 10.0, row_group_bytes: int = 64 * 1024 * 1024, consumer: Any = None) -> None:
        from astraflow.log import ConsumerGroups, LogConsumer, Topics
        from astraflow.objstore import ObjectStore, RunLayout

        self.cfg = cfg
        self.layout = RunLayout(cfg.run)
        self.store = store or ObjectStore.from_config(cfg)
        # A restarting S3 server is waited out (one line per backoff step), not a reason to exit.
        self._s3 = OutageReport("archiver: S3 endpoint", str(getattr(self.store, "endpoint", cfg.s3.endpoint)), log)
        topics = Topics(cfg.run)
        self.kinds: dict[str, tuple[str, str | None]] = {topics.trajectories: (R.TRAJECTORIES, None),
                                                         topics.metrics: (R.METRICS, None)}
        for p in policies:
            self.kinds[topics.batches(p)] = (R.BATCHES, p)
            self.kinds[topics.weights(p)] = (R.WEIGHTS, p)
        self.group_id = group_id or ConsumerGroups(cfg.run).archive
        self.consumer = consumer or LogConsumer(cfg, list(self.kinds), self.group_id, store=self.store,
                                                client_id=f"archiver-{cfg.run}", background=True)
        self.max_records, self.max_bytes, self.flush_s = max_records, max_bytes, flush_s
        self.row_group_bytes = row_group_bytes
        self.stats = ArchiveStats()
        self._buffers: dict[tuple[str, int], _Buffer] = {}
        # One upload thread: parts of a partition reach the bucket in offset order.
        self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive-upload")
        self._uploads: deque[tuple[Future[_Uploaded], list[Message]]] = deque()
        self._existing = self._list_parts()

    # -- recovery ----------------------------------------------------------------------------------
    def _list_parts(self) -> dict[tuple[str, int, int], list[str]]:
        """Parts already in the bucket, by (topic, partition, first offset) -> keys."""
        found: dict[tuple[str, int, int], list[str]] = {}
        for key in self.store.list(self.layout.archive_prefix()):
            m = _PART_RE.search(key)
            if m and m["topic"] in self.kinds:
                found.setdefault((m["topic"], int(m["partition"]), int(m["first"])), []).append(key)
        return found

    def _until(self, topic: str, partition: int, first: int) -> int | None:
        keys = self._existing.get((topic, partition, first))
        if not keys:
            return None
        last = max(int(R.parquet_meta(wait_out_outage(lambda: self.store.get_bytes(k), self._s3))[R.META_LAST])  # noqa: B023
                   for k in keys)
        log.info("%s/%d: a part from offset %d to %d exists (uploaded, not committed): rewriting it",
                 topic, partition, first, last)
        return last

    # -- consuming ---------------------------------------------------------------------------------
    def add(self, m: Message) -> None:
        """Buffer one record (flushes that partition first when its buffer is full)."""
        kind, policy = self.kinds[m.topic]
        tp = (m.topic, m.partition)
        buf = self._buffers.get(tp)
        if buf is not None and m.offset <= buf.last:
            # Re-delivered from the committed offset (a rebalance): start the buffer again.
            buf = self._buffers.pop(tp)
        if buf is None:
            buf = _Buffer(m.topic, m.partition, m.offset, m.offset - 1, time.monotonic(),
                          until=self._until(m.topic, m.partition, m.offset))
            self._buffers[tp] = buf
        try:
            for r in self._rows(kind, policy, m):
                buf.rows.setdefault((r.kind, r.policy), []).append(r)
            # The record's size on the log: Table.nbytes walks every buffer (~200 us a record).
            buf.nbytes += m.value_bytes
        except RecordSchemaError as exc:
            self.stats.skipped += 1
            log.warning("%s@%d/%d not archived: %s", m.topic, m.partition, m.offset, exc)
        buf.messages.append(m)
        buf.last = m.offset
        self.stats.records += 1
        if buf.until is not None:
            if buf.last >= buf.until:
                self._flush([buf])
        elif len(buf.messages) >= self.max_records or buf.nbytes >= self.max_bytes:
            self._flush([buf])

    @staticmethod
    def _rows(kind: str, policy: str | None, m: Message) -> list[R.Rows]:
        if kind == R.TRAJECTORIES:
            return R.trajectory_rows(m)
        if kind == R.BATCHES:
            return R.batch_rows(m)
        if kind == R.WEIGHTS:
            return R.weight_rows(m, policy or "")
        return R.metric_rows(m)

    def poll(self, timeout_s: float = 0.5, max_records: int = 2000) -> int:
        """One poll: buffer what came, flush what is due; returns the records polled."""
        msgs = self.consumer.poll(timeout_s=timeout_s, max_records=max_records)
        for m in msgs:
            if m.topic in self.kinds:
                self.add(m)
        now = time.monotonic()
        self._flush([b for b in self._buffers.values() if b.until is None and now - b.started >= self.flush_s])
        return len(msgs)

    # -- flushing ----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Flush every buffer (a buffer that must end at an earlier life's boundary waits for it) and
        wait until everything handed to the upload thread is uploaded and committed."""
        self._flush([b for b in self._buffers.values() if b.until is None or b.last >= b.until], wait=True)

    def _flush(self, buffers: list[_Buffer], *, wait: bool = False) -> None:
        """Hand ``buffers`` to the upload thread; commit every upload that has finished, in order
        (all of them with ``wait``)."""
        assigned = self.consumer.assignment
        for buf in buffers:
            self._buffers.pop((buf.topic, buf.partition), None)
            if (buf.topic, buf.partition) not in assigned:
                continue  # revoked: the new owner re-reads it from the committed offset
            self._existing.pop((buf.topic, buf.partition, buf.first), None)
            while len(self._uploads) >= MAX_PENDING_UPLOADS:  # bounded memory: wait for the oldest
                self._commit_uploaded(block=True)
            self._uploads.append((self._uploader.submit(self._upload, buf), buf.messages))
        self._commit_uploaded(block=wait)

    def _upload(self, buf: _Buffer) -> _Uploaded:
        """On the upload thread: one Parquet part per (kind, policy) of ``buf``, uploaded. Parquet
        encoding and the HTTP request release the GIL, so this overlaps with consuming."""
        t0 = time.monotonic()
        out = _Uploaded()
        for kind, policy, tables in _by_kind_and_policy(buf.rows):
            data = R.to_parquet(kind, tables, topic=buf.topic, partition=buf.partition, first_offset=buf.first,
                                last_offset=buf.last, row_group_bytes=self.row_group_bytes)
            key = self.layout.archive_part_key(kind, policy, buf.topic, buf.partition, buf.first)
            wait_out_outage(lambda: self.store.put_bytes(key, data, content_type=PARQUET), self._s3)  # noqa: B023
            out.keys.append(key)
            out.rows[kind] += sum(t.num_rows for t in tables)
            out.bytes += len(data)
        out.seconds = time.monotonic() - t0
        return out

    def _commit_uploaded(self, *, block: bool) -> None:
        """Commit the offsets of finished uploads, oldest first: a later buffer's offsets are never
        committed before an earlier one's part is in the bucket (an upload error raises here)."""
        while self._uploads and (block or self._uploads[0][0].done()):
            future, messages = self._uploads.popleft()
            done = future.result()
            self.before_commit(done.keys)
            self.consumer.commit(messages)
            self.stats.rows.update(done.rows)
            self.stats.parts += len(done.keys)
            self.stats.bytes += done.bytes
            self.stats.flush_s += done.seconds

    def before_commit(self, uploaded: list[str]) -> None:
        """Hook between upload and commit, with the keys just uploaded (tests crash here)."""

    # -- running -----------------------------------------------------------------------------------
    def run(self, stop: threading.Event, *, drain_s: float = 10.0, idle_exit_s: float | None = None) -> ArchiveStats:
        """Archive until ``stop`` is set (or, with ``idle_exit_s``, until nothing came for that long);
        then read on until a poll brings nothing and every partition is read to its end (at most
        ``drain_s``), flush everything and return.

        The drain waits for the group's assignment: an archiver restarted shortly before the stop
        (after a crash) is often still joining (its dead predecessor holds the partitions until its
        session times out); stopping at its first, empty poll would leave everything the predecessor
        had not committed out of the archive."""
        idle_since = time.monotonic()
        while not stop.is_set():
            if self.poll(0.5):
                idle_since = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                break
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            if not self.poll(0.3) and self.consumer.caught_up():
                break
        self.flush()
        if not self.consumer.commit_pending(timeout_s=3.0):
            # Uploaded, not committed: the next archiver rewrites the same parts (no duplicate, no gap).
            log.warning("archiver: the last commit did not go through; the next run of the archiver rewrites "
                        "the last parts under the same names")
        return self.stats

    def close(self) -> None:
        """Stop without committing what is still uploading (a crash's state: the next life rewrites it)."""
        self._uploader.shutdown(wait=True, cancel_futures=True)
        self.consumer.close()
