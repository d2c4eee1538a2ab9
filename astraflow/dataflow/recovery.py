"""Resume onto a log that lost records: what the dataflow's checkpoint says vs what the log still has.

Why: the dataflow's bucket state outlives its log when the log is in memory (the embedded default
for a run's own stack), when topics are deleted and re-created, or when retention ages records out.
Resumed blindly, it (1) skips records of a re-created topic that sit below offsets saved for the old
one — trajectories, weight announcements — and (2) keeps in-flight tasks whose records no node will
ever read, until ``task_timeout_s`` (15 min by default) expires them; with the in-flight cap full,
the run stalls. And (3) batches it served that the trainer had not trained yet died with the log, so
the weight versions its staleness bound waits for never come.

On start-up, :func:`recover` compares the topic ids saved with the checkpoint to the log's
(a re-created topic has a new id) and the in-flight tasks' recorded positions to each partition's
earliest offset, then: reads re-created consumed topics from their start, re-emits lost in-flight
tasks at once (counted ``tasks.reemitted_lost``), and re-bases the staleness accounting of policies
whose batch topic was re-created. With the same log (a dataflow killed and restarted), nothing
changes: records still on the log are read by nodes and by this dataflow as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astraflow.log.identity import earliest_offsets, recreated_topics, topic_ids
from astraflow.log.offsets import Partition

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.dataflow.emitter import InFlight
    from astraflow.dataflow.pipeline import Dataflow
    from astraflow.log import Topics
    from astraflow.records import Task

log = logging.getLogger(__name__)


@dataclass
class Recovery:
    """What :func:`recover` found and did."""

    topic_ids: dict[str, str | None]
    """The log's topic ids now: saved with the next checkpoint."""
    recreated: set[str] = field(default_factory=set)
    read_from_start: list[Partition] = field(default_factory=list)
    reemit: list[Task] = field(default_factory=list)
    """Lost in-flight tasks to send again (already counted ``tasks.reemitted_lost``)."""
    rebased: list[str] = field(default_factory=list)
    """Policies whose batch topic was re-created."""


def lost_tasks(in_flight: Mapping[str, InFlight], task_topic: Callable[[Task], str], recreated: set[str],
               earliest: Mapping[Partition, int]) -> list[str]:
    """Prompt ids of in-flight tasks whose records are gone: their topic was re-created, or their
    offset is below the partition's earliest (retention). A task with no recorded position (a
    checkpoint from before positions were recorded) is judged by its pool's topic alone."""
    lost = []
    for pid, f in in_flight.items():
        if f.position is None:
            if task_topic(f.task) in recreated:
                lost.append(pid)
            continue
        topic, partition, offset = f.position
        if topic in recreated or offset < earliest.get((topic, partition), 0):
            lost.append(pid)
    return lost


def recover(cfg: ClusterConfig, df: Dataflow, topics: Topics, saved_ids: Mapping[str, str | None],
            skip_below: MutableMapping[Partition, int], now: float,
            latest_version: Callable[[str], int | None], known_topics: Iterable[str] = ()) -> Recovery:
    """Check the restored state against the log (see the module docstring). ``skip_below`` (the
    checkpointed next offset per consumed partition) loses the partitions of re-created topics;
    ``latest_version(policy)`` reads the weight store (the bucket) for re-basing; ``known_topics``
    are the other topics whose ids the next checkpoint should record. Every topic named must exist
    already (the caller ensured them)."""
    in_flight = df.emitter.in_flight
    batch_topics = {topics.batches(p): p for p in df.batchers}

    def task_topic(t: Task) -> str:
        return topics.tasks(t.pool)

    wanted = ({*known_topics} | {t for t, _ in skip_below} | {task_topic(f.task) for f in in_flight.values()}
              | {f.position[0] for f in in_flight.values() if f.position} | set(batch_topics))
    rec = Recovery(topic_ids=topic_ids(cfg, wanted))
    rec.recreated = recreated_topics(saved_ids, rec.topic_ids)
    for tp in [tp for tp in skip_below if tp[0] in rec.recreated]:
        del skip_below[tp]
        rec.read_from_start.append(tp)
    standing = {(f.position[0], f.position[1]) for f in in_flight.values()
                if f.position and f.position[0] not in rec.recreated}
    earliest = earliest_offsets(cfg, standing)
    rec.reemit = df.emitter.reemit(lost_tasks(in_flight, task_topic, rec.recreated, earliest), now)
    for topic, policy in batch_topics.items():
        if topic in rec.recreated:
            version = latest_version(policy)
            df.batches_lost(policy, df.versions[policy] if version is None else version)
            rec.rebased.append(policy)
    if rec.recreated or rec.reemit:
        log.warning("dataflow %s: the log lost records since the checkpoint: re-created topics %s (read from "
                    "their start: %d partitions); re-emitting %d of %d in-flight tasks whose records are gone; "
                    "staleness re-based for %s", cfg.run, sorted(rec.recreated), len(rec.read_from_start),
                    len(rec.reemit), len(in_flight), rec.rebased or "no policy")
    return rec
