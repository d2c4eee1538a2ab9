"""Batch records taken back from a run's archive, for a trainer whose log no longer has them.

A trainer rolled back to an older kept checkpoint (``astraflow run --from-checkpoint``), or falling back
from a corrupt one, reads its batch topic from that checkpoint's offsets. Its rollback position keeps
those records in the log (:mod:`astraflow.log.retention`), unless something trimmed them anyway: a
reader held past ``max_held_records``, an external broker's ``retention.ms``. The archive keeps every
batch record's composition (its ``batches`` rows: batch id, trainer version, the episode ids in batch
order, at the record's log offset) and every trajectory as it was received (``trajectories`` rows), and
the dataflow batches trajectories unchanged, so the record is rebuilt exactly from the two.

Cost: the policy's archived batch rows of the partition, and its trajectory parts read once (only the
rows of the wanted episodes are decoded): done once per gap, at a rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from astraflow.archive import rows as R
from astraflow.archive.replay import archive_parts, read_row_groups
from astraflow.records import batch as batch_rec
from astraflow.records import trajectory

if TYPE_CHECKING:
    from astraflow.objstore import ObjectStore


@dataclass(frozen=True)
class ArchivedBatchRecord:
    """A batch record as the log had it, rebuilt from the archive: the fields of a log message a
    trainer reads (topic, partition, offset, key, timestamp, the batch's Arrow table)."""

    topic: str
    partition: int
    offset: int
    key: str
    """The batch id (batch records are keyed by it)."""
    timestamp_ms: int
    table: pa.Table


def _parts(store: ObjectStore, run: str, kind: str, policy: str, topic: str | None = None,
           partition: int | None = None) -> list[str]:
    """Keys of ``kind``'s parts under ``policy``'s folder (of ``topic``/``partition`` where given)."""
    wanted = f"/policy={policy}/part-"
    if topic is not None:
        wanted += f"{topic}-{partition}-"
    return [key for stream in archive_parts(store, run, kind) for key in stream if wanted in key]


def archived_batch_records(store: ObjectStore, run: str, policy: str, topic: str, partition: int,
                           first: int, last: int) -> list[ArchivedBatchRecord]:
    """The batch records of ``topic``:``partition`` at offsets ``first``..``last`` that the archive of
    ``run`` holds whole (composition and every trajectory), in offset order; offsets it lacks are left
    out (the caller says which)."""
    compositions: dict[int, list[dict]] = {}
    for table in read_row_groups(store, _parts(store, run, R.BATCHES, policy, topic, partition)):
        offsets = table.column("log_offset")
        table = table.filter(pc.and_(pc.greater_equal(offsets, first), pc.less_equal(offsets, last)))
        for row in table.select(["log_offset", "position", "batch_id", "trainer_version", "episode_id",
                                 "log_timestamp_ms"]).to_pylist():
            compositions.setdefault(row["log_offset"], []).append(row)
    if not compositions:
        return []
    wanted = pa.array(sorted({row["episode_id"] for rows in compositions.values() for row in rows}))
    found: dict[str, trajectory.Trajectory] = {}
    names = [f.name for f in trajectory.FIELDS]
    for table in read_row_groups(store, _parts(store, run, R.TRAJECTORIES, policy)):
        table = table.filter(pc.is_in(table.column("episode_id"), value_set=wanted))
        for t in trajectory.from_table(table.select(names)) if table.num_rows else []:
            found.setdefault(t.episode_id, t)  # a trajectory received twice: the same episode
    out = []
    for offset, rows in sorted(compositions.items()):
        rows.sort(key=lambda row: row["position"])
        if any(row["episode_id"] not in found for row in rows):
            continue  # a trajectory of it is not in the archive: not rebuilt
        b = batch_rec.Batch(batch_id=rows[0]["batch_id"], policy=policy, trainer_version=rows[0]["trainer_version"],
                            trajectories=[found[row["episode_id"]] for row in rows])
        out.append(ArchivedBatchRecord(topic, partition, offset, b.batch_id, rows[0]["log_timestamp_ms"] or 0,
                                       batch_rec.to_table(b)))
    return out
