"""Consumer lag from offsets we know to be true: acknowledged produce offsets and committed offsets.

Tansu's high watermarks (``end_offsets``) are wrong (3000 records produced, 1834 reported), so lag
here never asks the broker where a partition ends. Producers record every acknowledged offset in an
:class:`OffsetLedger`; ledgers from several producers merge (max per partition), e.g. after being
published as JSON on ``<run>.metrics``; lag = produced end - committed offset per partition.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from astraflow.log.admin import open_admin

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

Partition = tuple[str, int]
"""(topic, partition)."""


class OffsetLedger:
    """Per partition: the end of what was acknowledged (highest acked offset + 1) and how many records.

    Thread-safe: kafka-python resolves produce futures on its sender thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._end: dict[Partition, int] = {}
        self._count: dict[Partition, int] = {}

    def record(self, topic: str, partition: int, offset: int) -> None:
        key = (topic, partition)
        with self._lock:
            if offset + 1 > self._end.get(key, 0):
                self._end[key] = offset + 1
            self._count[key] = self._count.get(key, 0) + 1

    def merge(self, other: OffsetLedger | Mapping[str, Any]) -> None:
        """Fold another ledger (or its :meth:`to_json` form) into this one."""
        data = other.to_json() if isinstance(other, OffsetLedger) else other
        with self._lock:
            for topic, parts in data.get("end", {}).items():
                for p, end in parts.items():
                    key = (topic, int(p))
                    self._end[key] = max(self._end.get(key, 0), int(end))
            for topic, parts in data.get("count", {}).items():
                for p, n in parts.items():
                    key = (topic, int(p))
                    self._count[key] = self._count.get(key, 0) + int(n)

    def produced_end(self) -> dict[Partition, int]:
        """(topic, partition) -> highest acknowledged offset + 1."""
        with self._lock:
            return dict(self._end)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready snapshot, e.g. for a metrics record: ``{"end": {topic: {"0": n}}, "count": ...}``."""
        out: dict[str, Any] = {"end": {}, "count": {}}
        with self._lock:
            for field, src in (("end", self._end), ("count", self._count)):
                for (topic, p), v in src.items():
                    out[field].setdefault(topic, {})[str(p)] = v
        return out


def committed_offsets(cfg: ClusterConfig, group_id: str, timeout_s: float = 10.0) -> dict[Partition, int]:
    """(topic, partition) -> the group's committed offset (the next record it will read)."""
    return groups_committed_offsets(cfg, [group_id], timeout_s).get(group_id, {})


def groups_committed_offsets(cfg: ClusterConfig, groups: Iterable[str],
                             timeout_s: float = 10.0) -> dict[str, dict[Partition, int]]:
    """group -> :func:`committed_offsets`, for several groups in one OffsetFetch request."""
    admin = open_admin(cfg, timeout_s)
    try:
        got = admin.list_group_offsets(dict.fromkeys(sorted(set(groups))))
    finally:
        admin.close()
    return {g: {(tp.topic, tp.partition): om.offset for tp, om in offsets.items() if om.offset >= 0}
            for g, offsets in got.items()}


def compute_lag(
    produced_end: Mapping[Partition, int],
    committed: Mapping[Partition, int],
    topics: Iterable[str] | None = None,
) -> dict[Partition, int]:
    """Records acknowledged but not yet committed, per partition (never negative).

    A partition with nothing committed counts from offset 0 (``auto_offset_reset=earliest``).
    """
    wanted = set(topics) if topics is not None else None
    lag = {}
    for key, end in produced_end.items():
        if wanted is not None and key[0] not in wanted:
            continue
        lag[key] = max(0, end - committed.get(key, 0))
    return lag
