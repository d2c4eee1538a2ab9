"""Which offsets a consumer may commit: the contiguous processed prefix of what it was handed.

Kafka offsets are not always contiguous (control records, compaction), so "contiguous" means in
delivery order: a partition's commit point moves past a record only when it and every record
delivered before it were processed. Committing ``offset + 1`` of that prefix is at-least-once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

Partition = tuple[str, int]


def partitions_of(offsets: dict[str, int]) -> dict[Partition, int]:
    """Offsets keyed ``"<topic>:<partition>"`` (as checkpoints store them) keyed by :data:`Partition`."""
    return {(key.rsplit(":", 1)[0], int(key.rsplit(":", 1)[1])): offset for key, offset in offsets.items()}


class ProcessedOffsets:
    def __init__(self) -> None:
        self._pending: dict[Partition, deque[int]] = {}
        self._done: dict[Partition, set[int]] = {}
        self._next: dict[Partition, int] = {}  # offset to commit: end of the processed prefix
        self._committed: dict[Partition, int] = {}

    def delivered(self, tp: Partition, offset: int) -> None:
        self._pending.setdefault(tp, deque()).append(offset)

    def processed(self, tp: Partition, offset: int) -> bool:
        """Mark a delivered record processed; False if it is not pending here (partition revoked)."""
        pending = self._pending.get(tp)
        if not pending or offset < pending[0] or offset > pending[-1]:
            return False
        self._done.setdefault(tp, set()).add(offset)
        return True

    def undeliver(self, tp: Partition, from_offset: int) -> None:
        """Forget records from ``from_offset`` on (they will be fetched again)."""
        pending = self._pending.get(tp)
        while pending and pending[-1] >= from_offset:
            self._done.get(tp, set()).discard(pending.pop())

    def to_commit(self) -> dict[Partition, int]:
        """Partitions whose processed prefix moved past the last commit -> offset to commit."""
        out = {}
        for tp, pending in self._pending.items():
            done = self._done.get(tp, set())
            while pending and pending[0] in done:
                offset = pending.popleft()
                done.discard(offset)
                self._next[tp] = offset + 1
            nxt = self._next.get(tp)
            if nxt is not None and nxt > self._committed.get(tp, -1):
                out[tp] = nxt
        return out

    def committed(self, offsets: dict[Partition, int]) -> None:
        self._committed.update(offsets)

    def forget(self, tps: Iterable[Partition]) -> None:
        """Drop all state of partitions that were revoked or re-positioned."""
        for tp in list(tps):
            for d in (self._pending, self._done, self._next, self._committed):
                d.pop(tp, None)
