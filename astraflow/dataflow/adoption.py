"""Take back the tasks a lost life of the dataflow emitted after the state this one resumes from.

Why: the dataflow saves its state every ``checkpoint_every_s``. A life killed between two saves has
sent task records the saved state does not know; nodes run them anyway. Resumed blindly, the new life
drops their trajectories as ``unknown_task`` (2,600-2,800 of them for two kills in the chaos run) and
draws the same prompts again, so the nodes' work on them is wasted twice over.

Each state save records when it was taken (``saved_at_ms``, after the producer was flushed: every task
record created before it is in the state) and where the dataflow's task records ended on every task
partition (``task_ends``: the highest acknowledged offset + 1). On start-up the records after those
ends are read back (:func:`~astraflow.log.range_reader.read_to_end`), and the tasks of those created
after the save are taken in flight as they were sent
(:meth:`TaskEmitter.adopt <astraflow.dataflow.emitter.TaskEmitter.adopt>`). The record's creation time
is the lost life's own clock, like ``saved_at_ms``, so the rule needs no clock agreement between
hosts; the ends only spare reading what the state knows already. A topic the log re-created is left to
:mod:`astraflow.dataflow.recovery`; a state saved before these were recorded adopts nothing (the old
behaviour).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from astraflow.log.offsets import Partition
from astraflow.log.range_reader import read_to_end
from astraflow.records import RecordSchemaError, task

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.dataflow.pipeline import Dataflow

log = logging.getLogger(__name__)


def adopt_lost_emissions(cfg: ClusterConfig, df: Dataflow, task_topics: Iterable[str], partitions: int,
                         task_ends: dict[Partition, int], saved_at_ms: int, now: float) -> dict[Partition, int]:
    """Adopt the tasks of every record created after ``saved_at_ms`` on ``partitions`` partitions of
    each of ``task_topics``, reading each from its end in ``task_ends`` (from its start without one).
    Returns the ends after what was read, for the next save."""
    topics = sorted(set(task_topics))
    starts = {(t, p): task_ends.get((t, p), 0) for t in topics for p in range(partitions)}
    read = read_to_end(cfg, starts, expected_schemas=dict.fromkeys(topics, (task.SCHEMA_NAME, task.SCHEMA_VERSION)))
    ends = dict(task_ends)
    adopted = records = 0
    for m in read.messages:
        ends[(m.topic, m.partition)] = max(ends.get((m.topic, m.partition), 0), m.offset + 1)
        if m.timestamp_ms is None or m.timestamp_ms <= saved_at_ms:
            continue  # created before the save: the state knows it (in flight or finished)
        try:
            tasks = task.from_table(m.table) if m.table is not None else []
        except RecordSchemaError as exc:
            log.warning("dataflow: task record %s/%d@%d not adopted: %s", m.topic, m.partition, m.offset, exc)
            continue
        records += 1
        adopted += sum(df.emitter.adopt(t, (m.topic, m.partition, m.offset), now) for t in tasks)
    if adopted or not read.complete:
        log.warning("dataflow %s: %d tasks its lost life emitted after the saved state adopted from %d task "
                    "records%s", cfg.run, adopted, records,
                    "" if read.complete else " (the task topics were not all read to their end: the rest will be "
                                             "drawn again)")
    return ends
