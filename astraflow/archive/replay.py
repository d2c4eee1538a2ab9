"""Offline replay: an archived run's trajectories through the dataflow's own code, once per configuration.

No engine, no trainer, no broker: the archive's trajectory records and weight timeline (read from the
bucket, 8192 rows at a time) are merged in log-timestamp order and fed to a
:class:`~astraflow.dataflow.pipeline.Dataflow` built from a ``dataflow`` recipe section — the class the
online dataflow runs, so its staleness rule, filters and batch sampler (a user's plug-ins included,
by name) decide exactly as they would online. The task emitter is not replayed (prompt selection
needs rollouts): every archived task counts as known, with the recipe's group size.

What differs from the online run, by construction: trajectories whose task the online dataflow no
longer knew (``unknown_task``: expired or re-read after a restart) are judged here like any other;
records the online dataflow read in one poll are replayed in timestamp order.
"""

from __future__ import annotations

import heapq
import math
import queue
import statistics
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from astraflow.archive import rows as R
from astraflow.records import Batch, Task, Trajectory, trajectory

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.dataflow.config import DataflowConfig
    from astraflow.objstore import ObjectStore

T = TypeVar("T")
DROP_REASONS = ("stale", "duplicate", "unknown_policy", "in_dropped_group", "expired")


# -- reading the archive -----------------------------------------------------------------------------
def archive_parts(store: ObjectStore, run: str, kind: str) -> list[list[str]]:
    """Keys of ``kind``'s Parquet parts as streams: one list per (policy folder, topic, partition), in
    first-offset order (each stream is in log order; the streams interleave by timestamp)."""
    from astraflow.objstore import RunLayout

    streams: dict[tuple[str, str, int], list[tuple[int, str]]] = defaultdict(list)
    for key in store.list(RunLayout(run).archive_prefix(kind)):
        if not key.endswith(".parquet"):
            continue
        folder, name = key.rsplit("/", 1)
        topic, partition, first = name[len("part-"):-len(".parquet")].rsplit("-", 2)
        streams[(folder, topic, int(partition))].append((int(first), key))
    return [[key for _, key in sorted(parts)] for _, parts in sorted(streams.items())]


DECODE_ROWS = 8192
"""Rows read and decoded at a time: a slice's Arrow columns stay alive while any of its trajectories is
in the dataflow (lazy fields are read from them), so smaller slices bound memory, larger ones save calls."""
READ_AHEAD = 2
"""Slices read ahead of the replay, per stream, on a background thread."""


def read_row_groups(store: ObjectStore, keys: Iterable[str], rows: int = DECODE_ROWS) -> Iterator[pa.Table]:
    """The rows of each part in turn, at most ``rows`` at a time, read ahead on a background thread: the
    GET and the Parquet decoding release the GIL, so they overlap the dataflow's Python on another
    core. Memory holds one part's bytes and ``READ_AHEAD + 2`` slices (never a whole run or part)."""

    def slices() -> Iterator[pa.Table]:
        for key in keys:
            part = pq.ParquetFile(pa.BufferReader(store.get_bytes(key)))
            for batch in part.iter_batches(batch_size=rows):
                yield pa.Table.from_batches([batch])

    return read_ahead(slices(), READ_AHEAD)


def read_ahead(items: Iterator[T], depth: int) -> Iterator[T]:
    """``items``, produced on a daemon thread up to ``depth`` ahead of the consumer; its error is raised
    here, and the thread stops soon after the consumer does (the generator closed or collected)."""
    q: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((False, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put((False, exc))

    def consume() -> Iterator[T]:
        threading.Thread(target=work, name="archive-read-ahead", daemon=True).start()
        try:
            while True:
                more, item = q.get()
                if not more:
                    if item is not None:
                        raise item
                    return
                yield item
        finally:
            stop.set()

    return consume()


@dataclass(order=True)
class Event:
    """One log record to replay: a trajectory record's rows, or a weight announcement."""

    timestamp_ms: int
    partition: int
    offset: int
    kind: str = field(compare=False)
    trajectories: list[Trajectory] = field(default_factory=list, compare=False)
    policy: str = field(default="", compare=False)
    version: int = field(default=0, compare=False)


def trajectory_events(tables: Iterable[pa.Table]) -> Iterator[Event]:
    """Rows grouped back into the log records they came from (rows of a record are contiguous).

    Decoded a chunk at a time with lazy token fields (:func:`trajectory.from_table`), the record
    boundaries found over the log columns with numpy instead of row by row."""
    names = [f.name for f in trajectory.FIELDS]
    pending: Event | None = None
    for table in tables:
        for first in range(0, table.num_rows, DECODE_ROWS):
            chunk = table.slice(first, DECODE_ROWS)
            trajs = trajectory.from_table(chunk.select(names), lazy=True)
            parts = chunk.column("log_partition").to_numpy()
            offsets = chunk.column("log_offset").to_numpy()
            starts = np.flatnonzero((parts[1:] != parts[:-1]) | (offsets[1:] != offsets[:-1])) + 1
            starts = np.concatenate([[0], starts])
            stamps = chunk.column("log_timestamp_ms").take(starts).to_pylist()
            ends = [*starts[1:].tolist(), len(trajs)]
            for a, b, p, o, ts in zip(starts.tolist(), ends, parts[starts].tolist(), offsets[starts].tolist(), stamps,
                                      strict=True):
                if pending is not None and pending.partition == p and pending.offset == o:
                    pending.trajectories += trajs[a:b]  # a record cut by a chunk or row-group boundary
                    continue
                if pending is not None:
                    yield pending
                pending = Event(ts or 0, p, o, R.TRAJECTORIES, trajs[a:b])
    if pending is not None:
        yield pending


def weight_events(tables: Iterable[pa.Table]) -> list[Event]:
    out = []
    for table in tables:
        for row in table.to_pylist():
            if row["version"] is not None:
                out.append(Event(row["log_timestamp_ms"] or 0, -1, row["log_offset"], R.WEIGHTS,
                                 policy=row["policy"], version=int(row["version"])))
    return sorted(out)


def require_archive(store: ObjectStore, cfg: ClusterConfig, run: str) -> None:
    """:class:`ConfigError` naming the bucket prefix when ``run`` has no archived trajectories."""
    from astraflow.config import ConfigError
    from astraflow.objstore import RunLayout

    prefix = RunLayout(run).archive_prefix(R.TRAJECTORIES)
    if not any(True for _ in store.list(prefix)):
        raise ConfigError(f"no archive for run {run!r} in s3://{cfg.s3.bucket}/{prefix} "
                          "(was it run with --no-archive, or in another bucket?)")


@dataclass
class ArchivedRun:
    """The events of one archived run, re-readable once per configuration (streamed each time)."""

    store: ObjectStore
    run: str
    until: dict[int, int] | None = None
    """Per trajectories partition, the first offset not to replay (None: every archived record)."""

    def events(self) -> Iterator[Event]:
        """Every event in log order, trajectory records only up to :attr:`until`."""
        events = self.log_order()
        if self.until is None:
            return events
        until = self.until
        return (e for e in events if e.kind == R.WEIGHTS or e.offset < until.get(e.partition, 0))

    def log_order(self) -> Iterator[Event]:
        """The weight timeline and the trajectory records, merged in log-timestamp order."""
        weights = [e for stream in archive_parts(self.store, self.run, R.WEIGHTS)
                   for e in weight_events(read_row_groups(self.store, stream))]
        trajs = [trajectory_events(read_row_groups(self.store, stream))
                 for stream in archive_parts(self.store, self.run, R.TRAJECTORIES)]
        return heapq.merge(sorted(weights), *trajs)

    def dataflow_consumed(self) -> dict[int, int] | None:
        """Per trajectories partition, how far the online dataflow had read at its last state save (at
        the end of a finished run: everything it counted). Records after it — episodes that finished
        while the run stopped — never reached the online counters."""
        from astraflow.dataflow.service import STATE_OBJECT
        from astraflow.log import Topics
        from astraflow.objstore import RunLayout

        key = RunLayout(self.run).dataflow_key(STATE_OBJECT)
        if not self.store.exists(key):
            return None
        topic = Topics(self.run).trajectories
        return {int(p): int(o) for t, p, o in self.store.get_json(key).get("offsets", []) if t == topic}

    def online_counters(self) -> dict[str, int] | None:
        """The online dataflow's last counters (its last ``kind: dataflow`` metrics record), if archived."""
        from astraflow.records.control import DataflowCounters

        last = None
        keys = [key for stream in archive_parts(self.store, self.run, R.METRICS) for key in stream]
        for table in read_row_groups(self.store, keys):
            for row in table.select(["component", "kind", "json", "log_offset"]).to_pylist():
                is_dataflow = row["component"] == "dataflow" and row["kind"] == "dataflow"
                if is_dataflow and (last is None or row["log_offset"] > last[0]):
                    last = (row["log_offset"], row["json"])
        return DataflowCounters.model_validate_json(last[1]).counters if last else None


# -- replaying -----------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    name: str
    counters: dict[str, int]
    """The dataflow's own counters after the replay (``trajectories.*``, ``batches.<policy>.*``)."""
    batches: int = 0
    trajectories_batched: int = 0
    received_by: dict[str, Counter] = field(default_factory=dict)
    """``task_type`` / ``policy`` -> value -> trajectories received."""
    batched_by: dict[str, Counter] = field(default_factory=dict)
    groups: RunningStats = field(default_factory=lambda: RunningStats())
    """Per batched group: variance of its rewards (0 = no learning signal under GRPO)."""
    advantages: RunningStats = field(default_factory=lambda: RunningStats())
    """Per batched trajectory: reward - its group's mean."""
    staleness: Counter = field(default_factory=Counter)
    """Batched trajectories by (version at batching - oldest token version)."""
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        c = self.counters
        received = c.get("trajectories.received", 0)
        dropped = {k: c.get(f"trajectories.{k}", 0) for k in DROP_REASONS}
        groups_dropped = {k.split(":", 1)[1]: v for k, v in c.items()
                          if k.startswith("trajectories.groups_dropped:")}
        return {
            "name": self.name,
            "received": received,
            "kept": c.get("trajectories.kept", 0),
            "dropped": dropped,
            "groups_dropped": groups_dropped,
            "pending": c.get("trajectories.pending", 0),
            "batches": self.batches,
            "trajectories_batched": self.trajectories_batched,
            "zero_variance_groups": self.groups.zeros,
            "groups_batched": self.groups.n,
            "reward_variance_mean": self.groups.mean(),
            "advantage_abs_mean": self.advantages.abs_mean(),
            "advantage_std": self.advantages.std(),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "by_task_type": _by(self.received_by.get("task_type"), self.batched_by.get("task_type")),
            "by_policy": _by(self.received_by.get("policy"), self.batched_by.get("policy")),
            "trajectories_per_s": round(received / self.seconds) if self.seconds else None,
        }


@dataclass
class RunningStats:
    """Count, zeros, mean, |mean| and standard deviation of a stream, in constant memory."""

    n: int = 0
    zeros: int = 0
    total: float = 0.0
    total_abs: float = 0.0
    total_sq: float = 0.0

    def add(self, x: float) -> None:
        self.add_all((x,))

    def add_all(self, xs: list[float] | tuple[float, ...]) -> None:
        """``add`` each of ``xs`` in turn, without a call per value (the same sums in the same order; from
        Python 3.12 ``sum`` of floats is compensated, so the totals are if anything more exact)."""
        self.n += len(xs)
        self.zeros += xs.count(0.0)
        self.total = sum(xs, self.total)
        self.total_abs = sum(map(abs, xs), self.total_abs)
        self.total_sq = sum([x * x for x in xs], self.total_sq)

    def mean(self) -> float | None:
        return round(self.total / self.n, 4) if self.n else None

    def abs_mean(self) -> float | None:
        return round(self.total_abs / self.n, 4) if self.n else None

    def std(self) -> float | None:
        if self.n < 2:
            return None
        return round(max(0.0, self.total_sq / self.n - (self.total / self.n) ** 2) ** 0.5, 4)


def _by(received: Counter | None, batched: Counter | None) -> dict[str, dict[str, int]]:
    received, batched = received or Counter(), batched or Counter()
    return {k: {"received": received[k], "batched": batched[k]} for k in sorted(received)}


class ServedBatches:
    """The batches a fresh :class:`Dataflow` of ``section`` serves from ``events``, in order; after the
    last one, :attr:`counters` holds the dataflow's own counters. ``on_trajectories`` sees every
    trajectory record's rows before the dataflow does. Both ``astraflow replay`` and the archive feed
    (``--from-archive``) iterate this: one path from the archive to batches."""

    def __init__(self, section: DataflowConfig, events: Iterable[Event], group_size: int,
                 on_trajectories: Callable[[list[Trajectory]], None] | None = None) -> None:
        self.section, self.events, self.group_size = section, events, group_size
        self.on_trajectories = on_trajectories
        self.counters: dict[str, int] = {}

    def __iter__(self) -> Iterator[Batch]:
        from astraflow.dataflow.pipeline import Dataflow

        df = Dataflow(self.section, dataset=[])
        group_size = self.group_size

        last: list[Task] = [Task(prompt_id="", prompt="", samples=group_size)]

        def known_task(task_id: str) -> Task:  # every archived task was emitted by the run (none kept: memory)
            # A group's rows arrive together: the last task answers most lookups (no Task built per row).
            if last[0].prompt_id != task_id:
                last[0] = Task(prompt_id=task_id, prompt="", samples=group_size)
            return last[0]

        df.processor.task_lookup = known_task
        for event in self.events:
            if event.kind == R.WEIGHTS:
                df.on_weights(event.policy, event.version)
                continue
            if self.on_trajectories is not None:
                self.on_trajectories(event.trajectories)
            df.ingest(event.trajectories)
            yield from df.take_batches()
        self.counters = df.counters()


def replay(name: str, section: DataflowConfig, events: Iterable[Event], group_size: int) -> ReplayResult:
    """Feed ``events`` to a fresh :class:`Dataflow` of ``section``; every batch it serves is measured."""
    import time

    t0 = time.perf_counter()
    result = ReplayResult(name, {}, received_by={"task_type": Counter(), "policy": Counter()},
                          batched_by={"task_type": Counter(), "policy": Counter()})

    def count_received(trajectories: list[Trajectory]) -> None:
        result.received_by["task_type"].update(map(_TASK_TYPE, trajectories))
        result.received_by["policy"].update(map(_POLICY, trajectories))

    batches = ServedBatches(section, events, group_size, count_received)
    for b in batches:
        _measure(result, b)
    result.counters = batches.counters
    result.seconds = time.perf_counter() - t0
    return result


_TASK_TYPE, _POLICY, _GROUP, _REWARD = (attrgetter(a) for a in ("task_type", "policy", "group_id", "reward"))
_MIN_VERSION = attrgetter("min_version")


def _measure(result: ReplayResult, b: Batch) -> None:
    trajs = b.trajectories
    result.batches += 1
    result.trajectories_batched += len(trajs)
    result.batched_by["task_type"].update(map(_TASK_TYPE, trajs))
    result.batched_by["policy"].update(map(_POLICY, trajs))
    result.staleness.update(map(b.trainer_version.__sub__, map(_MIN_VERSION, trajs)))
    groups: dict[str, list[float]] = defaultdict(list)
    for g, r in zip(map(_GROUP, trajs), map(_REWARD, trajs), strict=True):
        groups[g].append(r)
    for rewards in groups.values():
        mean = statistics.fmean(rewards)
        deviations = [r - mean for r in rewards]
        # The population variance in floats (statistics.pvariance computes it exactly with fractions,
        # ~100 us a group); rounded to 12 digits they agree (checked on 100k random groups).
        result.groups.add(round(math.fsum([d * d for d in deviations]) / len(rewards), 12))
        result.advantages.add_all(deviations)
