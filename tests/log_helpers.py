"""Reading a producer's :class:`~astraflow.log.OffsetLedger` the way its readers do: through its JSON
form (the one published on ``<run>.metrics``); and where a partition's log starts and ends."""

from __future__ import annotations

from collections.abc import Iterable

from astraflow.config import ClusterConfig
from astraflow.log import OffsetLedger
from astraflow.log.lag import Partition


def acked_count(ledger: OffsetLedger) -> dict[Partition, int]:
    """(topic, partition) -> number of acknowledged records."""
    return {(topic, int(p)): n for topic, parts in ledger.to_json()["count"].items() for p, n in parts.items()}


def partition_offsets(cfg: ClusterConfig, partitions: Iterable[Partition], *, end: bool,
                      timeout_s: float = 10.0) -> dict[Partition, int]:
    """(topic, partition) -> the log's end (``end``: the offset the next record gets) or its start (the
    first offset a fetch can still read: records below it were trimmed), in one ListOffsets round."""
    from kafka import TopicPartition
    from kafka.admin import OffsetSpec

    wanted = {TopicPartition(t, p): OffsetSpec.LATEST if end else OffsetSpec.EARLIEST for t, p in partitions}
    if not wanted:
        return {}
    from astraflow.log.admin import open_admin

    admin = open_admin(cfg, timeout_s)
    try:
        got = admin.list_partition_offsets(wanted)
    finally:
        admin.close()
    return {(tp.topic, tp.partition): answer.offset for tp, answer in got.items()}
