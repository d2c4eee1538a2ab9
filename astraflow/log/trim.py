"""How records leave a broker's log, per broker (what to remove is :mod:`astraflow.log.retention`'s call).

* **The embedded Tansu, s3 log** (the default): Tansu 0.6's object-store engine has no retention and
  no DeleteRecords (its handler is ``todo!()``: the broker drops the connection), keeps each produced
  batch as one object, ``clusters/<id>/topics/<topic>/partitions/<p:010>/records/<base offset:020>.batch``,
  and lists a partition's objects on every fetch, so a fetch costs more as the partition ages
  (docs/running.md, "Log storage"). :class:`TansuObjectTrimmer` deletes the objects of batches below
  the trim point, as Kafka's retention deletes whole segments. Tansu then answers the partition's
  earliest offset with the first batch left, serves fetches from there, and keeps its high watermark
  (``watermark.json``) and so the offsets of new records (``tests/test_log_retention.py``).
* **Tansu's memory log**: the records live inside the broker process; nothing outside it can remove
  them, and they are gone at its stop anyway.
* **Any other broker** (Apache Kafka, Redpanda, MSK, ...): its own retention (``retention.ms``,
  ``retention.bytes``) keeps the log bounded and its fetches do not slow down with age; size it above
  the longest time a reader (the archiver above all) may be down. AstraFlow does not trim it.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from astraflow.log.offsets import Partition

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.objstore import ObjectStore

log = logging.getLogger(__name__)

# Where the embedded broker (:mod:`astraflow.embedded.tansu`) keeps its s3 log: the layout this trimmer
# deletes from, so it is stated here, below both.
TANSU_BUCKET = "tansu"
"""The broker's own bucket on the embedded S3 when the log is durable."""
TANSU_CLUSTER_ID = "tansu_cluster"
"""The cluster id the broker is started with (Tansu's default, so older state dirs still read): its
s3 log's keys start with ``clusters/<id>/``."""


@dataclass(frozen=True)
class TrimResult:
    records: int = 0
    """Records removed (the span of offsets that left the log)."""
    units: int = 0
    """What the broker removed for them (Tansu: stored batches)."""
    log_start: int | None = None
    """The partition's first offset after the trim (None: not known)."""
    cut_to: int | None = None
    """Where ``max_held`` moved the trim point above the readers' (None: it did not)."""
    stored_end: int | None = None
    """The first offset of the partition's last stored batch: the log reaches at least this far."""


class LogTrimmer(ABC):
    """Removes a partition's records below an offset, where the broker lets it."""

    @abstractmethod
    def trim(self, partition: Partition, below: int, older_than: float, max_held: int | None = None) -> TrimResult:
        """Remove records of ``partition`` whose offsets are all below ``below`` and that were written
        before ``older_than`` (Unix seconds); records it cannot remove exactly are kept. ``max_held``: where
        ``below`` lies more than this many offsets behind the partition's last stored batch, trim up to that
        far behind it instead (:attr:`TrimResult.cut_to`)."""


_BATCH = re.compile(r"/records/(\d{20})\.batch$")


class TansuObjectTrimmer(LogTrimmer):
    """Deletes the stored batches of the embedded Tansu's s3 log (``store`` on the broker's bucket)."""

    def __init__(self, store: ObjectStore, cluster_id: str) -> None:
        self.store = store
        self.cluster_id = cluster_id

    def records_prefix(self, partition: Partition) -> str:
        topic, index = partition
        return f"clusters/{self.cluster_id}/topics/{topic}/partitions/{index:010d}/records/"

    def trim(self, partition: Partition, below: int, older_than: float, max_held: int | None = None) -> TrimResult:
        batches = []  # (base offset, key, written at)
        for obj in self.store.list_objects(self.records_prefix(partition)):
            m = _BATCH.search(obj["Key"])
            if m:
                batches.append((int(m[1]), obj["Key"], obj["LastModified"].timestamp()))
        if not batches:
            return TrimResult()
        batches.sort()
        # The end is read from the stored batches, not the broker's high watermark (Tansu's is wrong on
        # its s3 log, docs/architecture facts): the log reaches at least the last batch's first offset.
        stored_end = batches[-1][0]
        cut_to = None
        if max_held is not None and stored_end - below > max_held:
            below = cut_to = stored_end - max_held
        # Batch i holds offsets base[i] .. base[i+1]-1. It goes when the batch after it also lies below
        # the trim point: Tansu reads the batch before the one a fetch starts in, so that one stays.
        doomed = 0
        while (doomed + 2 < len(batches) and batches[doomed + 2][0] <= below
               and batches[doomed][2] < older_than):
            doomed += 1
        if doomed:
            self.store.delete_many(key for _, key, _ in batches[:doomed])
        return TrimResult(records=batches[doomed][0] - batches[0][0], units=doomed, log_start=batches[doomed][0],
                          cut_to=cut_to, stored_end=stored_end)


def trimmer_for(cfg: ClusterConfig) -> LogTrimmer | None:
    """The trimmer of ``cfg``'s broker, or None (said in the log) where AstraFlow does not trim it."""
    from astraflow.objstore import ObjectStore

    storage = cfg.kafka.embedded_log
    if storage == "s3":
        tansu_cfg = cfg.model_copy(update={"s3": cfg.s3.model_copy(update={"bucket": TANSU_BUCKET})})
        return TansuObjectTrimmer(ObjectStore.from_config(tansu_cfg), TANSU_CLUSTER_ID)
    if storage == "memory":
        log.info("log retention: the embedded broker's memory log cannot be trimmed from outside it "
                 "(it is lost at the broker's stop); the log keeps every record of the run")
    else:
        log.info("log retention: %s is not the embedded broker; its own retention (retention.ms) bounds "
                 "the log", cfg.kafka.bootstrap)
    return None
