"""Take back what a lost life of the dataflow sent after the state this one resumes from.

Why: the dataflow saves its state every ``checkpoint_every_s``. A life killed between two saves has
sent task and batch records the saved state does not know; nodes run the tasks and the trainer trains
the batches anyway. Resumed blindly, the new life dropped the nodes' trajectories of those tasks as
``unknown_task`` (2,600-4,100 of them for two kills in the chaos run) and drew the same prompts again;
it judged the trajectories of those batches a second time (as stale, by then) and made batches again
under ids the trainer had trained, which the trainer skips, groups never trained in them included.

Each state save records when it was taken (``saved_at_ms``, after the producer was flushed: every
record created before it is in the state) and where the dataflow's task and batch records end on
each partition (``produced_ends``: the highest acknowledged offset + 1, all lives together). On start-up the
records after those ends are read back (:func:`~astraflow.log.range_reader.read_to_end`). Of those
created after the save, the tasks are taken in flight as they were sent
(:meth:`TaskEmitter.adopt <astraflow.dataflow.emitter.TaskEmitter.adopt>`), then the batches are
counted as served (:meth:`Dataflow.adopt_batch <astraflow.dataflow.pipeline.Dataflow.adopt_batch>`), in
the order they were sent. A record's creation time is the lost life's own clock, like
``saved_at_ms``, so the rule needs no clock agreement between hosts; the ends only spare reading what
the state knows already. A topic the log re-created is left to :mod:`astraflow.dataflow.recovery`; a
state saved before these were recorded adopts nothing (the old behaviour).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from astraflow.log.offsets import Partition
from astraflow.log.range_reader import read_to_end
from astraflow.records import RecordSchemaError, batch, task

if TYPE_CHECKING:
    import pyarrow as pa

    from astraflow.config import ClusterConfig
    from astraflow.dataflow.pipeline import Dataflow
    from astraflow.log import Message

log = logging.getLogger(__name__)
T = TypeVar("T")


def adopt_lost_emissions(cfg: ClusterConfig, df: Dataflow, task_topics: Mapping[str, int], batch_topics: list[str],
                         ends: dict[Partition, int], saved_at_ms: int, now: float) -> dict[Partition, int]:
    """Adopt the tasks and batches of the records created after ``saved_at_ms`` on ``task_topics``
    (topic -> its partition count) and ``batch_topics`` (one partition each), reading each partition
    from its end in ``ends`` (from its start without one). Returns the ends after what was read, for
    the next save."""
    partitions = {**task_topics, **dict.fromkeys(batch_topics, 1)}
    starts = {(t, p): ends.get((t, p), 0) for t, n in partitions.items() for p in range(n)}
    schemas = {**dict.fromkeys(task_topics, (task.SCHEMA_NAME, task.SCHEMA_VERSION)),
               **dict.fromkeys(batch_topics, (batch.SCHEMA_NAME, batch.SCHEMA_VERSION))}
    read = read_to_end(cfg, starts, expected_schemas=schemas)
    out = dict(ends)
    lost: list[Message] = []
    for m in read.messages:
        out[(m.topic, m.partition)] = max(out.get((m.topic, m.partition), 0), m.offset + 1)
        if m.timestamp_ms is not None and m.timestamp_ms > saved_at_ms and m.table is not None:
            lost.append(m)  # created before the save: the state knows it (in flight, finished, served)
    tasks = [m for m in lost if m.schema_name == task.SCHEMA_NAME]
    batches = sorted((m for m in lost if m.schema_name == batch.SCHEMA_NAME), key=lambda m: m.offset)
    adopted_tasks = adopted_batches = 0
    for m in tasks:  # first: a batch's groups finish the tasks they belong to
        for t in _rows(m, task.from_table):
            adopted_tasks += df.emitter.adopt(t, (m.topic, m.partition, m.offset), now)
    for m in batches:
        for b in _rows(m, lambda table: [batch.from_table(table)]):
            adopted_batches += df.adopt_batch(b)
    if lost or not read.complete:
        log.warning("dataflow %s: adopted %d tasks and %d batches its lost life sent after the saved state "
                    "(%d task and %d batch records read after the saved ends, %d of them from before the save)%s",
                    cfg.run, adopted_tasks, adopted_batches, sum(m.topic in task_topics for m in read.messages),
                    sum(m.topic not in task_topics for m in read.messages), len(read.messages) - len(lost),
                    "" if read.complete else "; not every partition was read to its end: the tasks not adopted "
                                             "will be drawn again, the batches made again")
    return out


def _rows(m: Message, parse: Callable[[pa.Table], list[T]]) -> list[T]:
    """``parse(m.table)``, or nothing (logged) when the rows break the record contract."""
    try:
        return parse(m.table)
    except RecordSchemaError as exc:
        log.warning("dataflow: record %s/%d@%d not adopted: %s", m.topic, m.partition, m.offset, exc)
        return []
