"""Log retention: the log is a buffer of what is in flight, the archive is the history.

A record may leave the log once every reader of its topic has committed past it and it is older than
``keep_s``. The readers are the run's own consumer groups, fixed by the recipe (:func:`run_readers`):
the archiver's group reads every topic it archives, so nothing leaves the log before it is in the
archive; the trainer's group commits only what a checkpoint holds, the dataflow's what its saved
state holds, a pool's nodes a task whose trajectories are acknowledged. A reader that has committed
nothing on a partition yet holds the whole partition. Groups outside the map (a node's own weights
group, a replay's throwaway group) pin nothing: they read from the log's end or accept its start.

The dataflow comes back for records it has consumed or sent: a dataflow restarted after a crash adopts
the task and batch records its lost life sent after its last save and looks up its in-flight tasks'
records. It holds that position as the group ``<run>.dataflow-recovery`` (committed with each state save,
:mod:`astraflow.log.positions`), a reader of the task and batch topics like the others, so those records
stay for as long as it is down. ``keep_s`` is only a margin on top of the positions. A trainer holds the
consumed offsets of its oldest kept checkpoint as ``<run>.trainer-rollback.<policy>`` (committed after each
save), so that a rollback to any kept checkpoint (``astraflow run --from-checkpoint``), or a fall back from a
corrupt one, finds the batches it trains again.

A run without an archiver (``astraflow run --no-archive``) leaves the archive group out of the readers:
the log is trimmed all the same (it is a buffer; the archive, when there is one, is the history).

A hold has a bound, ``max_held_records`` per partition behind the log's end: a reader further behind (an
archiver down for hours, a dataflow that never comes back) no longer keeps the log from being trimmed,
and what it lost is said (:class:`Cut`: an error line here, a record on ``<run>.metrics`` from the
component that trims).

How records leave is the broker's business (:mod:`astraflow.log.trim`); this module decides how far.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.log.groups import ConsumerGroups
from astraflow.log.lag import groups_committed_offsets
from astraflow.log.offsets import Partition
from astraflow.log.topics import Topics

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig, LogRetentionSettings
    from astraflow.log.trim import LogTrimmer

log = logging.getLogger(__name__)

CommittedOffsets = Mapping[str, Mapping[Partition, int]]
"""group id -> (topic, partition) -> the group's committed offset (the next record it reads)."""


def run_readers(run: str, pools: Iterable[str], policies: Iterable[str], *,
                archived: bool = True) -> dict[str, list[str]]:
    """topic -> the consumer groups that must have read a record before it may leave the log (the
    archiver's only where the run has one)."""
    topics, groups = Topics(run), ConsumerGroups(run)
    archive = [groups.archive] if archived else []
    readers = {topics.tasks(pool): [groups.raas(pool), groups.dataflow_recovery] for pool in pools}
    for policy in policies:
        readers[topics.batches(policy)] = [groups.trainer(policy), groups.trainer_rollback(policy),
                                           groups.dataflow_recovery, *archive]
        readers[topics.weights(policy)] = [groups.dataflow, *archive]
    readers[topics.trajectories] = [groups.dataflow, *archive]
    readers[topics.metrics] = [groups.dataflow, *archive]
    return readers


def trim_points(readers: Mapping[str, list[str]], committed: CommittedOffsets) -> dict[Partition, int]:
    """(topic, partition) -> the offset below which every reader of the topic has committed; only
    partitions on which every reader has committed something."""
    points: dict[Partition, int] = {}
    for topic, groups in readers.items():
        partitions = {tp for g in groups for tp in committed.get(g, {}) if tp[0] == topic}
        for tp in sorted(partitions):
            offsets = [committed.get(g, {}).get(tp) for g in groups]
            if all(o is not None for o in offsets):
                points[tp] = min(o for o in offsets if o is not None)
    return points


@dataclass(frozen=True)
class Cut:
    """A partition trimmed below some readers' positions, because they held more than ``max_held_records``."""

    partition: Partition
    log_start: int
    """The partition's first offset after the trim."""
    stored_end: int
    """The first offset of its last stored batch when the trim was decided."""
    max_held_records: int
    lost: dict[str, tuple[int, int]]
    """Reader group -> (first, last) offsets it had not read that left the log."""

    def describe(self) -> str:
        topic, index = self.partition
        return (f"{topic}:{index} held more than max_held_records={self.max_held_records} records behind its "
                f"end ({self.stored_end}): trimmed to {self.log_start} anyway; lost to "
                + ", ".join(f"{g}: offsets {a}..{b}" for g, (a, b) in sorted(self.lost.items())))


@dataclass
class RetentionStats:
    passes: int = 0
    records: int = 0
    """Records removed (by offset span) over all passes."""
    units: int = 0
    """What the broker removed: stored batches (Tansu's objects) or partitions trimmed."""
    errors: int = 0
    """Passes that failed for another reason than the broker being unreachable."""
    unreachable: int = 0
    """Passes skipped because the broker did not answer (restarting): nothing is trimmed meanwhile."""
    cut: int = 0
    """Records trimmed below some reader's position (``max_held_records``)."""
    last_pass_s: float = 0.0
    below: dict[Partition, int] = field(default_factory=dict)
    """Per partition, the log's start after the last pass that trimmed it."""

    def as_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "records": self.records, "units": self.units, "errors": self.errors,
                "unreachable": self.unreachable, "cut": self.cut, "last_pass_s": round(self.last_pass_s, 3),
                "log_start": {f"{t}:{p}": o for (t, p), o in sorted(self.below.items())}}


class LogRetention:
    """Trims a run's topics every ``settings.interval_s`` on a thread of its own (:meth:`start`)."""

    def __init__(self, readers: Mapping[str, list[str]], trimmer: LogTrimmer, settings: LogRetentionSettings,
                 committed: Callable[[Iterable[str]], CommittedOffsets], *, clock: Callable[[], float] = time.time,
                 on_cut: Callable[[Cut], None] | None = None):
        self.readers = dict(readers)
        self.on_cut = on_cut
        """Told each :class:`Cut` (the trimming component sends it as a record), after the error line."""
        self.trimmer = trimmer
        self.settings = settings
        self.committed = committed
        self.clock = clock
        self.stats = RetentionStats()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    def for_run(cls, cfg: ClusterConfig, pools: Iterable[str], policies: Iterable[str], *,
                archived: bool = True, on_cut: Callable[[Cut], None] | None = None) -> LogRetention | None:
        """Retention of run ``cfg.run`` on its broker (``archived``: the run has an archiver, whose group
        must have read a record too), or None (said in the log) where it is off or the broker's log
        cannot be trimmed."""
        from astraflow.log.trim import trimmer_for

        settings = cfg.kafka.retention
        if not settings.enabled:
            log.info("log retention is off (kafka.retention.enabled: false): the log keeps every record")
            return None
        trimmer = trimmer_for(cfg)
        if trimmer is None:
            return None
        return cls(run_readers(cfg.run, pools, policies, archived=archived), trimmer, settings,
                   lambda groups: groups_committed_offsets(cfg, groups), on_cut=on_cut)

    def pass_once(self) -> dict[Partition, int]:
        """One pass: read the readers' commits and trim each partition below them (or up to
        ``max_held_records`` behind its end, said as a :class:`Cut`); returns the records removed per
        partition."""
        t0 = time.monotonic()
        committed = self.committed({g for groups in self.readers.values() for g in groups})
        older_than = self.clock() - self.settings.keep_s
        points = trim_points(self.readers, committed)
        for topic, groups in self.readers.items():  # a reader that committed nothing holds the whole partition
            for tp in {tp for g in groups for tp in committed.get(g, {}) if tp[0] == topic}:
                points.setdefault(tp, 0)
        removed: dict[Partition, int] = {}
        for tp, below in sorted(points.items()):
            before = self.stats.below.get(tp, 0)
            result = self.trimmer.trim(tp, below, older_than, max_held=self.settings.max_held_records)
            self.stats.units += result.units
            if result.records:
                removed[tp] = result.records
                self.stats.records += result.records
            if result.log_start is not None:
                self.stats.below[tp] = result.log_start
                if result.cut_to is not None and result.log_start > below:
                    self._say_cut(tp, committed, before, result.log_start, result.stored_end or 0)
        self.stats.passes += 1
        self.stats.last_pass_s = time.monotonic() - t0
        return removed

    def _say_cut(self, tp: Partition, committed: CommittedOffsets, before: int, log_start: int, end: int) -> None:
        """Say which readers lost which offsets when ``tp`` was trimmed to ``log_start`` below them."""
        lost = {}
        for group in self.readers.get(tp[0], []):
            first = max(committed.get(group, {}).get(tp, 0), before)
            if first < log_start:
                lost[group] = (first, log_start - 1)
        if not lost:
            return  # lost on an earlier pass, said then
        cut = Cut(tp, log_start, end, self.settings.max_held_records, lost)
        self.stats.cut += max(b - a + 1 for a, b in lost.values())
        log.error("log retention: %s", cut.describe())
        if self.on_cut is not None:
            self.on_cut(cut)

    def run(self, stop: threading.Event) -> None:
        """Pass every ``interval_s`` until ``stop``; a failed pass is logged and the next one tries again
        (a broker or bucket restarting is not a reason to stop the component that trims)."""
        from kafka.errors import KafkaError

        while not stop.wait(self.settings.interval_s):
            try:
                removed = self.pass_once()
            except Exception as exc:  # noqa: BLE001 - retention must never take its component down
                if isinstance(exc, KafkaError) and exc.retriable:  # a lost connection: the broker restarts
                    self.stats.unreachable += 1
                    log.warning("log retention: broker unreachable (%s: %s); trying again in %g s",
                                type(exc).__name__, exc, self.settings.interval_s)
                    continue
                self.stats.errors += 1
                log.warning("log retention: pass failed (%s: %s); trying again in %g s",
                            type(exc).__name__, exc, self.settings.interval_s)
                continue
            if removed:
                log.info("log retention: removed %d records (%s)", sum(removed.values()),
                         ", ".join(f"{t}:{p} {n}" for (t, p), n in sorted(removed.items())))

    def start(self) -> LogRetention:
        self._thread = threading.Thread(target=self.run, args=(self._stop,), name="log-retention", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
