"""A run's own topics as the replay's input (``astraflow replay RUN --from-log``): for a run that is
still going, or one that ran with ``--no-archive``, while its log still holds the records.

Same interface as :class:`~astraflow.archive.replay.ArchivedRun`, so the replay path is the same one.
The trajectories, weight announcements and metrics are read from the start of the run's topics with a
throwaway consumer group (nothing committed; the run's own groups are untouched) until every partition
is read to its end. The events are held in memory (the archive replay streams them): use it for a
run's worth of records, not for a long history.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astraflow.archive import rows as R
from astraflow.archive.replay import ArchivedRun, Event

if TYPE_CHECKING:
    from collections.abc import Iterator

    from astraflow.config import ClusterConfig

log = logging.getLogger(__name__)
QUIET_S = 1.0
"""Stop reading once every partition is read to its end and nothing came for this long."""


@dataclass
class LiveRun(ArchivedRun):
    """The events of run ``run`` read from its topics (see the module docstring)."""

    cfg: ClusterConfig | None = None
    policies: list[str] = field(default_factory=list)
    timeout_s: float = 120.0
    _events: list[Event] | None = None
    _counters: dict[str, int] | None = None

    def log_order(self) -> Iterator[Event]:
        if self._events is None:
            self._read()
        return iter(self._events or [])

    def online_counters(self) -> dict[str, int] | None:
        if self._events is None:
            self._read()
        return self._counters

    def _read(self) -> None:
        from astraflow.config import ConfigError
        from astraflow.log import LogConsumer, Topics
        from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA
        from astraflow.records import trajectory
        from astraflow.records.control import (
            METRICS_TOPIC_SCHEMAS,
            DataflowCounters,
            WeightAnnouncement,
            is_control,
        )

        topics = Topics(self.run)
        weights = {topics.weights(p): p for p in self.policies}
        # The online dataflow's schemas per topic: a record it would refuse is refused here too (and,
        # like every group that reads it, dead-lettered once more with this group's name).
        expected = {topics.trajectories: (trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION),
                    topics.metrics: METRICS_TOPIC_SCHEMAS, **dict.fromkeys(weights, WEIGHT_ANNOUNCEMENT_SCHEMA)}
        consumer = LogConsumer(self.cfg, [topics.trajectories, topics.metrics, *weights],
                               f"{self.run}.replay-{uuid.uuid4().hex[:8]}", expected, client_id=f"replay-{self.run}")
        events: list[Event] = []
        counters, counters_offset = None, -1
        deadline = time.monotonic() + self.timeout_s
        quiet_since = time.monotonic()
        try:
            while True:
                msgs = consumer.poll(timeout_s=0.3, max_records=2000)
                now = time.monotonic()
                if msgs:
                    quiet_since = now
                elif now - quiet_since >= QUIET_S and consumer.caught_up():
                    break
                if now > deadline:
                    raise ConfigError(f"replay --from-log: the topics of run {self.run!r} were not read to their "
                                      f"end within {self.timeout_s:.0f} s (is the broker up, does the run exist?)")
                for m in msgs:
                    stamp = m.timestamp_ms or 0
                    if m.topic == topics.trajectories and m.table is not None:
                        events.append(Event(stamp, m.partition, m.offset, R.TRAJECTORIES,
                                            trajectory.from_table(m.table, lazy=True)))
                    elif not is_control(m.schema_name, m.schema_version):
                        continue  # untyped figures on the metrics topic
                    elif isinstance(record := m.record, WeightAnnouncement) and m.topic in weights:
                        events.append(Event(stamp, -1, m.offset, R.WEIGHTS, policy=weights[m.topic],
                                            version=record.version))
                    elif isinstance(record, DataflowCounters) and m.offset > counters_offset:
                        counters, counters_offset = record.counters, m.offset
        finally:
            consumer.close()  # leaves the throwaway group, commits nothing
        log.info("replay --from-log: %d events of run %s", len(events), self.run)
        self._events, self._counters = sorted(events), counters

