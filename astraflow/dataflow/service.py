"""The dataflow process: the :class:`Dataflow` logic wired to the log and the bucket.

One consumer (group ``<run>.dataflow``) reads ``<run>.trajectories``, every ``<run>.weights.<policy>``
and ``<run>.metrics``. Batches go to ``<run>.batches.<policy>``, tasks to ``<run>.tasks.<pool>``,
counters (every ``metrics_every_s``) and the autoscaling report (every ``autoscale.interval_s``) to
``<run>.metrics``.

Exactly-once effect on state, at-least-once on the wire: every ``checkpoint_every_s`` the producer is
flushed (batches and tasks acknowledged), then the Dataflow state and the next offset per partition
are written to ``<run>/dataflow/state.json``, and only then are the consumed offsets committed. On
restart the state is loaded and records below the checkpointed offsets (delivered again because the
commit may not have happened) are skipped, so nothing is counted twice and nothing is lost.

The state also records the ids of the run's topics and where each in-flight task's record landed,
so a dataflow resumed onto a log that lost records (an in-memory log restarted, topics re-created,
retention) notices it at start-up and re-emits the lost tasks at once
(:mod:`astraflow.dataflow.recovery`). And it records when it was saved and where its task and batch
records ended, so that a dataflow killed between two saves is followed by one that adopts the tasks
and batches sent after the last save instead of wasting the work on them
(:mod:`astraflow.dataflow.adoption`).

Control records read, typed (:mod:`astraflow.records.control`; the consumer dead-letters one that does
not parse): a :class:`WeightAnnouncement` gives a policy's new version and ``batch_id``, the last batch
trained into it, which re-anchors the staleness accounting (:meth:`Dataflow.on_weights`); a trainer's
:class:`TrainerStep` (``wait_s`` and ``step_s``: seconds waited for its batch / spent on the step) feeds
the autoscaler; a trainer's :class:`TrainerSkipped` tells that a served batch will train no version
(:meth:`Dataflow.batch_skipped`). A node's status record names its pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from astraflow.config import ClusterConfig
from astraflow.dataflow.adoption import adopt_lost_emissions
from astraflow.dataflow.autoscaler import autoscale_report
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.pipeline import Dataflow
from astraflow.dataflow.recovery import recover
from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA
from astraflow.log.identity import topic_ids, topic_partitions
from astraflow.log.producer import key_partition, record_policy
from astraflow.log.retention import Cut, LogRetention
from astraflow.log.topics import TASK_PARTITIONS
from astraflow.outage import OutageReport, wait_out_outage
from astraflow.records import RecordSchemaError, Task, batch, task, trajectory
from astraflow.records.control import (
    METRICS_TOPIC_SCHEMAS,
    DataflowCounters,
    LogRecordsDropped,
    NodeStatus,
    TrainerSkipped,
    TrainerStep,
    WeightAnnouncement,
    is_control,
    send_control,
)

log = logging.getLogger(__name__)

STATE_OBJECT = "state.json"
COMPONENT_ID = "dataflow"


def state_key(run: str) -> str:
    """The bucket key of ``run``'s saved dataflow state: ``<run>/dataflow/state.json``."""
    from astraflow.objstore import RunLayout

    return RunLayout(run).dataflow_key(STATE_OBJECT)


class _Window:
    """Trainer wait/step seconds and trajectory counts since the last autoscaling report."""

    def __init__(self) -> None:
        self.consumed_before = 0
        self.entered_before = 0
        self.reset()

    def reset(self) -> None:
        self.wait_s = 0.0
        self.step_s = 0.0
        self.nodes: dict[str, set[str]] = defaultdict(set)


class DataflowService:
    """One dataflow process: resumes the :class:`Dataflow` from its checkpoint in the bucket, recovers
    what the log lost (:mod:`astraflow.dataflow.recovery`), then reads, emits, checkpoints and trims the
    run's log in a loop (:meth:`run`). ``train_steps``: the recipe's ``trainer.steps``, so that no task
    is emitted beyond what the run's last batches need (:meth:`Dataflow.run_room`); ``archived``: the run
    has an archiver, whose group log retention waits for."""

    def __init__(self, cfg: ClusterConfig, section: DataflowConfig, dataset: Iterable[Task], *,
                 checkpoint_every_s: float = 5.0, metrics_every_s: float = 2.0,
                 pools: Iterable[str] = ("default",), train_steps: int | None = None, archived: bool = True) -> None:
        from astraflow.log import ConsumerGroups, LogConsumer, LogProducer, Topics
        from astraflow.log.positions import HeldPosition
        from astraflow.objstore import ObjectStore

        self.cfg, self.section = cfg, section
        self.checkpoint_every_s, self.metrics_every_s = checkpoint_every_s, metrics_every_s
        self.task_partitions: dict[str, int] = {}
        """Pool -> partitions of its task topic, as the broker has it (the launcher made it one per node)."""
        self.topics = Topics(cfg.run)
        self.store = ObjectStore.from_config(cfg)
        self.s3 = OutageReport("dataflow: state save, S3 endpoint", str(cfg.s3.endpoint), log)
        self.state_key = state_key(cfg.run)
        self.pools, self.archived = list(pools), archived
        self.recovery_position = HeldPosition(cfg, ConsumerGroups(cfg.run).dataflow_recovery)
        """Where a restarted dataflow will read back from: held for log retention with each save."""
        self.retention: LogRetention | None = None
        """Trims the run's log while :meth:`run` runs (None where retention is off or impossible)."""
        self.cuts: queue.SimpleQueue[Cut] = queue.SimpleQueue()
        """What retention trimmed below a reader (its thread puts, the loop sends them on the metrics topic)."""
        self.df = Dataflow(section, dataset, train_steps=train_steps)
        self.weight_topics = {self.topics.weights(p): p for p in section.policies}
        self.placing: list[tuple[str, Any]] = []
        self.sending: list[tuple[str, Any]] = []
        """(batch id, ack future) of batch records not yet acknowledged."""
        """(prompt id, ack future) of task records not yet acknowledged: their positions."""
        saved = self._resume()
        self.skip_below = {(t, int(p)): o for t, p, o in saved.get("offsets", [])}
        self._ensure_topics(pools)
        task_topics = [self.topics.tasks(p) for p in self.task_partitions]
        self.recovery = recover(cfg, self.df, self.topics, dict(saved.get("topic_ids", {})), self.skip_below,
                                time.time(), latest_version=lambda policy: _latest_version(cfg, policy),
                                known_topics=[self.topics.trajectories, self.topics.metrics, *self.weight_topics,
                                              *task_topics])
        self.offsets = dict(self.skip_below)
        self.resumed_ends: dict[tuple[str, int], int] = self._resumed_ends(saved, task_topics)
        """Per task and batch partition, where the records of this dataflow's earlier lives end."""
        # No linger: each record here (a batch, a version's tasks) is what the trainer or a node waits for
        # next, and the ones sent together in a loop pass still batch behind the first in flight.
        self.producer = LogProducer(cfg, f"{cfg.run}.{COMPONENT_ID}", linger_ms=0)
        self.consumer = LogConsumer(
            cfg,
            [self.topics.trajectories, self.topics.metrics, *self.weight_topics],
            group_id=ConsumerGroups(cfg.run).dataflow,
            # Per topic, so a wrong schema name or version on any of them is dead-lettered, not read.
            expected_schemas={self.topics.trajectories: (trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION),
                              self.topics.metrics: METRICS_TOPIC_SCHEMAS,
                              **dict.fromkeys(self.weight_topics, WEIGHT_ANNOUNCEMENT_SCHEMA)},
        )
        self.window = _Window()
        self.uncommitted: list[Any] = []

    def _resume(self) -> dict[str, Any]:
        """Load the checkpointed state, if any; the saved object ({} for a fresh run)."""
        from astraflow.objstore.errors import ObjectNotFoundError

        try:
            saved = self.store.get_json(self.state_key)
        except ObjectNotFoundError:
            return {}  # a fresh run
        self.df.load_state_dict(saved["dataflow"])
        log.info("dataflow %s resumed from %s", self.cfg.run, self.state_key)
        return saved

    def _resumed_ends(self, saved: dict[str, Any], task_topics: list[str]) -> dict[tuple[str, int], int]:
        """Where the earlier lives' task and batch records end: nothing in a fresh run; else the saved
        ends, moved past the records that the lost life sent after its last save, which are adopted (a
        partition without a saved end is read from its start)."""
        ends = {(t, int(p)): o for t, p, o in saved.get("produced_ends", [])}
        if "saved_at_ms" not in saved:  # a fresh run, or saved before saves recorded their time
            return ends
        recreated = self.recovery.recreated
        return adopt_lost_emissions(self.cfg, self.df,
                                    {self.topics.tasks(pool): n for pool, n in self.task_partitions.items()
                                     if self.topics.tasks(pool) not in recreated},
                                    [t for t in (self.topics.batches(p) for p in self.section.policies)
                                     if t not in recreated],
                                    ends, int(saved["saved_at_ms"]), time.time())

    def _hold_recovery_position(self, ends: dict[tuple[str, int], int] | None = None) -> None:
        """Hold, for log retention, what a restart would read back: on each task and batch partition
        the records from the saved ends on, and those of the in-flight tasks (looked up on resume)."""
        self.recovery_position.hold(recovery_positions(self.df, self._produced_ends() if ends is None else ends))

    def _produced_ends(self) -> dict[tuple[str, int], int]:
        """Where this dataflow's task and batch records end, all its lives together."""
        ends = dict(self.resumed_ends)
        for tp, end in self.producer.ledger.produced_end().items():
            if tp[0] != self.topics.metrics:
                ends[tp] = max(ends.get(tp, 0), end)
        return ends

    def _ensure_topics(self, pools: Iterable[str]) -> None:
        from astraflow.log.admin import ensure_run_topics

        ensure_run_topics(self.cfg, {}, list(self.section.policies))
        for pool in {*pools, *self.df.in_flight_pools()}:
            self._open_pool_topic(pool)

    def run(self, stop_event: threading.Event, *, stop_when_finished: bool = False) -> dict[str, int]:
        """Read, emit and checkpoint until ``stop_event`` (or, with ``stop_when_finished``, until the
        dataset is used up and nothing is in flight); a last checkpoint, then the final counters."""
        self._send_tasks(self.recovery.reemit)
        self._hold_recovery_position()  # before trimming starts: what this life's recovery read stays
        # The dataflow trims the run's log (it runs as long as the run does; the archive, if any, is one
        # more reader): a run without an archiver stays as fast at its end as at its start.
        self.retention = retention = LogRetention.for_run(
            self.cfg, {*self.pools, *self.task_partitions}, list(self.section.policies), archived=self.archived,
            on_cut=self.cuts.put)
        if retention is not None:
            retention.start()
        last_ckpt = last_metrics = last_report = time.monotonic()
        try:
            while not stop_event.is_set():
                msgs = self.consumer.poll(timeout_s=0.2, max_records=500)
                now = time.time()
                self._read(msgs)
                self._emit(now)
                mono = time.monotonic()
                self._send_cuts()
                if mono - last_metrics >= self.metrics_every_s:
                    _publish_metrics(self.producer, self.topics.metrics, self.df, now, self.consumer.handoff.drain())
                    last_metrics = mono
                if mono - last_report >= self.section.autoscale.interval_s:
                    _publish_report(self.producer, self.topics.metrics, self.df, self.window, self.section, now)
                    last_report = mono
                if mono - last_ckpt >= self.checkpoint_every_s:
                    self._checkpoint()
                    last_ckpt = mono
                if stop_when_finished and self.df.finished:
                    break
            _publish_metrics(self.producer, self.topics.metrics, self.df, time.time(), self.consumer.handoff.drain())
            self._checkpoint()
            return self.df.counters()
        finally:
            if retention is not None:
                retention.stop()
            self._send_cuts()
            self.recovery_position.close()
            self.consumer.close()
            self.producer.close()

    def _send_cuts(self) -> None:
        """Each cut retention made below a reader, as a record on the metrics topic."""
        while not self.cuts.empty():
            send_control(self.producer, self.topics.metrics, COMPONENT_ID,
                         LogRecordsDropped.of(self.cuts.get(), component=COMPONENT_ID, time=time.time()))

    def _read(self, msgs: list[Any]) -> None:
        for m in msgs:
            self.uncommitted.append(m)
            tp = (m.topic, m.partition)
            if m.offset < self.skip_below.get(tp, -1):
                continue  # already in the checkpointed state
            self.offsets[tp] = m.offset + 1
            if m.topic == self.topics.trajectories:
                _ingest(self.df, m, self.window)
            elif m.topic in self.weight_topics:
                _on_weights(self.df, self.weight_topics[m.topic], m)
            elif m.topic == self.topics.metrics:
                _on_metrics(self.df, m, self.window)

    def _emit(self, now: float) -> None:
        """Expire overdue tasks, send the batches that are ready and the tasks now allowed."""
        self.df.expire(now)
        for b in self.df.take_batches():
            self.sending.append((b.batch_id, self.producer.send_table(
                self.topics.batches(b.policy), b.batch_id, batch.to_table(b), batch.SCHEMA_NAME, batch.SCHEMA_VERSION,
                policy=b.policy)))
        self._send_tasks(self.df.next_tasks(now))
        _record_positions(self.df, self.placing)
        _check_batches_written(self.sending)

    def _send_tasks(self, tasks: Iterable[Task]) -> None:
        """The tasks emitted together, one record per pool and partition: each task lands in the
        partition its own prompt id hashes to (so the same node takes it as with a record per task),
        and a node reads, decodes and commits a few records per batch of tasks instead of one each."""
        records: dict[tuple[str, int], list[Task]] = {}
        for t in tasks:
            self._ensure_pool_topic(t.pool)  # a dataset may name pools beyond ``pools``
            records.setdefault((t.pool, key_partition(t.prompt_id, self.task_partitions[t.pool])), []).append(t)
        for (pool, _partition), group in records.items():
            # keyed by the first prompt id: it hashes to the partition every task of the group does
            ack = self.producer.send_table(self.topics.tasks(pool), group[0].prompt_id, task.to_table(group),
                                           task.SCHEMA_NAME, task.SCHEMA_VERSION,
                                           policy=record_policy(t.policy for t in group))
            self.placing.extend((t.prompt_id, ack) for t in group)

    def _ensure_pool_topic(self, pool: str) -> None:
        """A pool met after start-up (a dataset may name pools beyond ``pools``): its topic, and its id
        for the recovery's bookkeeping."""
        if pool not in self.task_partitions:
            topic = self._open_pool_topic(pool)
            if topic not in self.recovery.topic_ids:
                self.recovery.topic_ids.update(topic_ids(self.cfg, [topic]))

    def _open_pool_topic(self, pool: str) -> str:
        """The pool's task topic exists (created here at the default size if the launcher did not) and
        its real partition count is known: tasks are grouped by the partition their keys hash to."""
        from astraflow.log import ensure_topics

        topic = self.topics.tasks(pool)
        ensure_topics(self.cfg, {topic: TASK_PARTITIONS})
        self.task_partitions[pool] = topic_partitions(self.cfg, [topic])[topic]
        return topic

    def _checkpoint(self) -> None:
        """Flush, save the state with the next offset per partition, then commit what was read."""
        self.producer.flush()  # batches/tasks derived from the state must be on the log before it is saved
        # After the flush: every task record has its position, and each created later is not in the state.
        saved_at_ms = int(time.time() * 1000)
        _record_positions(self.df, self.placing)
        _check_batches_written(self.sending)
        ends = self._produced_ends()
        state = {"dataflow": self.df.state_dict(),
                 "offsets": [[t, p, o] for (t, p), o in self.offsets.items()], "topic_ids": self.recovery.topic_ids,
                 "saved_at_ms": saved_at_ms, "produced_ends": [[t, p, o] for (t, p), o in ends.items()]}
        # A restarting S3 server is waited out (one line per backoff step), not a reason to exit.
        wait_out_outage(lambda: self.store.put_json(self.state_key, state), self.s3)
        self._hold_recovery_position(ends)  # after the save: the held position never passes the saved one
        self.consumer.commit(self.uncommitted)
        self.uncommitted.clear()


def _ingest(df: Dataflow, m: Any, window: _Window) -> None:
    try:
        if m.table is None or m.schema_name != trajectory.SCHEMA_NAME:
            raise RecordSchemaError(f"expected {trajectory.SCHEMA_NAME} records, got {m.schema_name!r}")
        trajs = trajectory.from_table(m.table)
    except RecordSchemaError as exc:
        # The codec accepted the bytes but the rows break the record contract: count, never crash.
        df.refuse_record()
        log.warning("trajectory record %s/%s@%s refused: %s", m.topic, m.partition, m.offset, exc)
        return
    for t in trajs:
        pool = df.in_flight_pool(t.task_id)
        if pool is not None and t.node_id:
            window.nodes[pool].add(t.node_id)
    df.ingest(trajs)


def _on_weights(df: Dataflow, policy: str, m: Any) -> None:
    # The consumer expects only announcements here, parsed at decode, and dead-letters one that does not parse.
    announcement = m.record
    if isinstance(announcement, WeightAnnouncement):
        # The version and the batch it was trained through, together: a trainer restarted from an older
        # checkpoint republishes it as a fresh version, which must not open room before the re-anchoring.
        df.on_weights(policy, announcement.version, announcement.batch_id)


def _on_metrics(df: Dataflow, m: Any, window: _Window) -> None:
    if m.key == COMPONENT_ID or not is_control(m.schema_name, m.schema_version):
        return  # its own records, and untyped figures (which steer nothing)
    record = m.record  # parsed at decode: a bad one never gets here
    if isinstance(record, TrainerSkipped):  # a duplicate or an invalid batch record
        df.batch_skipped(record.policy, record.batch_id)
    elif isinstance(record, TrainerStep):
        window.wait_s += record.wait_s
        window.step_s += record.step_s
    elif isinstance(record, NodeStatus):  # the pools that have nodes
        window.nodes[record.pool].add(record.node_id)


def _publish_metrics(producer: Any, topic: str, df: Dataflow, now: float, handoff_ms: dict[str, dict]) -> None:
    send_control(producer, topic, COMPONENT_ID, DataflowCounters(time=now, versions=dict(df.versions),
                                                                 counters=df.counters(), handoff_ms=handoff_ms))


def _publish_report(producer: Any, topic: str, df: Dataflow, window: _Window, section: DataflowConfig,
                    now: float) -> None:
    """The autoscaling report over the window since the previous one (``autoscale.interval_s``)."""
    counters = df.counters()
    consumed_total = sum(v for k, v in counters.items() if k.endswith(".trajectories_batched"))
    entered_total = counters.get("trajectories.received", 0)
    consumed = consumed_total - window.consumed_before
    entered = entered_total - window.entered_before
    window.consumed_before, window.entered_before = consumed_total, entered_total
    pools = {
        pool: {"nodes": len(nodes), "wait_s": window.wait_s, "step_s": window.step_s,
               "consumed": consumed, "entered": entered}
        for pool, nodes in window.nodes.items()
    }
    if pools:
        send_control(producer, topic, COMPONENT_ID, autoscale_report(section.autoscale, pools, now))
    window.reset()


def recovery_positions(df: Dataflow, ends: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """Per task and batch partition, the first record a restarted dataflow may read back: its saved
    end (adoption reads on from there), or an in-flight task's record before it (recovery looks each
    one up: gone, the task would be drawn again)."""
    positions = dict(ends)
    for f in df.emitter.in_flight.values():
        if f.position is not None:
            topic, partition, offset = f.position
            positions[(topic, partition)] = min(positions.get((topic, partition), offset), offset)
    return positions


def _record_positions(df: Dataflow, placing: list[tuple[str, Any]]) -> None:
    """Move the acknowledged task records' positions into the in-flight table (kept in ``placing``:
    those not acknowledged yet). A record the broker refused ends the process (:class:`RecordNotWritten`):
    kafka-python's producer stays failed after a fatal broker error (seen when Tansu's storage, the
    bucket, restarted under it), so carrying on would leave the task in flight until it expires; the
    supervisor restarts the dataflow, which re-emits what it emitted after its last state save."""
    _settle(placing, "task", lambda prompt_id, ack: df.task_placed(prompt_id, (ack.topic, ack.partition, ack.offset)))


def _check_batches_written(sending: list[tuple[str, Any]]) -> None:
    """Forget the acknowledged batch records; a refused one ends the process (:class:`RecordNotWritten`).
    Carrying on would leave the trainer waiting for a batch that is not on the log while the staleness
    bound holds every task back (a whole run stalled so when its S3 server, Tansu's storage, was killed
    while a batch was in flight). The restarted dataflow re-reads the trajectories after its last save
    and makes the batch again; the batch records that did land are adopted."""
    _settle(sending, "batch", lambda batch_id, ack: None)


def _settle(pending: list[tuple[str, Any]], kind: str, acked: Callable[[str, Any], None]) -> None:
    """Hand each acknowledged ``(id, ack future)`` of ``pending`` to ``acked`` and keep the rest; a
    record the broker refused raises :class:`RecordNotWritten`."""
    waiting = []
    for key, fut in pending:
        if not fut.done():
            waiting.append((key, fut))
        elif fut.exception() is not None:
            raise RecordNotWritten(f"{kind} {key} was not written to the log: {fut.exception()}")
        else:
            acked(key, fut.result())
    pending[:] = waiting


class RecordNotWritten(RuntimeError):
    """The broker refused a task or batch record: the dataflow exits to be restarted with a fresh producer."""


def _latest_version(cfg: ClusterConfig, policy: str) -> int | None:
    """The newest weight version in the bucket (the source of truth when announcements were lost)."""
    from astraflow.delta.store import WeightStore

    return WeightStore.from_config(cfg, policy).latest_version()
