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
(:mod:`astraflow.dataflow.recovery`).

Control records read (JSON): a weight announcement is ``{"version": int, ...}`` (the record key is
used when there is no ``version`` field); a trainer metrics record carrying ``wait_s`` and
``step_s`` (seconds waited for a batch / spent per step since its last record) feeds the autoscaler;
a trainer's ``{"event": "skipped", "reason": "duplicate", "batch_id": ...}`` tells that a served
batch will train no version (:meth:`Dataflow.batch_skipped`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from astraflow.config import ClusterConfig
from astraflow.dataflow.autoscaler import autoscale_report
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.pipeline import Dataflow
from astraflow.dataflow.recovery import recover
from astraflow.log.codec import METRICS_SCHEMA, WEIGHT_ANNOUNCEMENT_SCHEMA
from astraflow.log.identity import topic_ids
from astraflow.outage import OutageReport, wait_out_outage
from astraflow.records import RecordSchemaError, Task, batch, task, trajectory

log = logging.getLogger(__name__)

STATE_OBJECT = "state.json"
COMPONENT_ID = "dataflow"


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


def run_dataflow(
    cfg: ClusterConfig,
    section: DataflowConfig,
    stop_event: threading.Event,
    *,
    dataset: Iterable[Task],
    checkpoint_every_s: float = 5.0,
    metrics_every_s: float = 2.0,
    pools: Iterable[str] = ("default",),
    task_partitions: int = 4,
    stop_when_finished: bool = False,
) -> dict[str, int]:
    """Run until ``stop_event`` is set (or, with ``stop_when_finished``, until the dataset is used
    up and nothing is in flight); returns the final counters. Resumes from the bucket checkpoint."""
    from astraflow.log import ConsumerGroups, LogConsumer, LogProducer, Topics, ensure_topics
    from astraflow.objstore import ObjectStore, RunLayout
    from astraflow.objstore.errors import ObjectNotFoundError

    topics = Topics(cfg.run)
    store = ObjectStore.from_config(cfg)
    s3 = OutageReport("dataflow: state save, S3 endpoint", str(cfg.s3.endpoint), log)
    state_key = RunLayout(cfg.run).dataflow_key(STATE_OBJECT)
    df = Dataflow(section, dataset)

    skip_below: dict[tuple[str, int], int] = {}
    saved_ids: dict[str, str | None] = {}
    try:
        saved = store.get_json(state_key)
    except ObjectNotFoundError:
        pass  # a fresh run
    else:
        df.load_state_dict(saved["dataflow"])
        skip_below = {(t, int(p)): o for t, p, o in saved["offsets"]}
        saved_ids = dict(saved.get("topic_ids", {}))
        log.info("dataflow %s resumed from %s", cfg.run, state_key)

    weight_topics = {topics.weights(p): p for p in section.policies}
    ensure_topics(
        cfg,
        {
            topics.trajectories: 1,
            topics.metrics: 1,
            **{w: 1 for w in weight_topics},
            **{topics.batches(p): 1 for p in section.policies},
        },
    )
    ready_pools: set[str] = set()
    placing: list[tuple[str, Any]] = []
    """(prompt id, ack future) of task records not yet acknowledged: their positions."""

    def ensure_pool_topic(pool: str) -> None:
        if pool not in ready_pools:
            ensure_topics(cfg, {topics.tasks(pool): task_partitions})
            ready_pools.add(pool)
            if topics.tasks(pool) not in recovery.topic_ids:
                recovery.topic_ids.update(topic_ids(cfg, [topics.tasks(pool)]))

    def send_task(t: Task) -> None:
        ensure_pool_topic(t.pool)  # a dataset may name pools beyond ``pools``
        placing.append((t.prompt_id, producer.send_table(topics.tasks(t.pool), t.prompt_id, task.to_table([t]),
                                                         task.SCHEMA_NAME, task.SCHEMA_VERSION,
                                                         policy=t.policy or None)))

    for pool in {*pools, *(f.task.pool for f in df.emitter.in_flight.values())}:
        ensure_topics(cfg, {topics.tasks(pool): task_partitions})
        ready_pools.add(pool)
    recovery = recover(cfg, df, topics, saved_ids, skip_below, time.time(),
                       latest_version=lambda policy: _latest_version(cfg, policy),
                       known_topics=[topics.trajectories, topics.metrics, *weight_topics,
                                     *(topics.tasks(p) for p in ready_pools)])
    offsets = dict(skip_below)
    # No linger: each record here (a batch, a version's tasks) is what the trainer or a node waits for
    # next, and the ones sent together in a loop pass still batch behind the first in flight.
    producer = LogProducer(cfg, f"{cfg.run}.{COMPONENT_ID}", linger_ms=0)
    consumer = LogConsumer(
        cfg,
        [topics.trajectories, topics.metrics, *weight_topics],
        group_id=ConsumerGroups(cfg.run).dataflow,
        # Per topic, so a wrong schema name or version on any of them is dead-lettered, not read.
        expected_schemas={topics.trajectories: (trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION),
                          topics.metrics: METRICS_SCHEMA, **{w: WEIGHT_ANNOUNCEMENT_SCHEMA for w in weight_topics}},
    )
    for t in recovery.reemit:
        send_task(t)
    window = _Window()
    uncommitted: list[Any] = []
    last_ckpt = last_metrics = last_report = time.monotonic()
    try:
        while not stop_event.is_set():
            msgs = consumer.poll(timeout_s=0.2, max_records=500)
            now = time.time()
            for m in msgs:
                uncommitted.append(m)
                tp = (m.topic, m.partition)
                if m.offset < skip_below.get(tp, -1):
                    continue  # already in the checkpointed state
                offsets[tp] = m.offset + 1
                if m.topic == topics.trajectories:
                    _ingest(df, m, window)
                elif m.topic in weight_topics:
                    _on_weights(df, weight_topics[m.topic], m)
                elif m.topic == topics.metrics:
                    _on_metrics(df, m, window)
            df.expire(now)
            for b in df.take_batches():
                producer.send_table(topics.batches(b.policy), b.batch_id, batch.to_table(b),
                                    batch.SCHEMA_NAME, batch.SCHEMA_VERSION, policy=b.policy)
            for t in df.next_tasks(now):
                send_task(t)
            _record_positions(df, placing)
            mono = time.monotonic()
            if mono - last_metrics >= metrics_every_s:
                _publish_metrics(producer, topics.metrics, df, now, consumer.handoff.drain())
                last_metrics = mono
            if mono - last_report >= section.autoscale.interval_s:
                _publish_report(producer, topics.metrics, df, window, section, now)
                last_report = mono
            if mono - last_ckpt >= checkpoint_every_s:
                _checkpoint(producer, store, state_key, df, offsets, consumer, uncommitted, placing,
                            recovery.topic_ids, s3)
                last_ckpt = mono
            if stop_when_finished and df.finished:
                break
        _publish_metrics(producer, topics.metrics, df, time.time(), consumer.handoff.drain())
        _checkpoint(producer, store, state_key, df, offsets, consumer, uncommitted, placing, recovery.topic_ids,
                    s3)
        return df.counters()
    finally:
        consumer.close()
        producer.close()


def _ingest(df: Dataflow, m: Any, window: _Window) -> None:
    try:
        if m.table is None or m.schema_name != trajectory.SCHEMA_NAME:
            raise RecordSchemaError(f"expected {trajectory.SCHEMA_NAME} records, got {m.schema_name!r}")
        trajs = trajectory.from_table(m.table)
    except RecordSchemaError as exc:
        # The codec accepted the bytes but the rows break the record contract: count, never crash.
        df.processor.counters["invalid_records"] += 1
        log.warning("trajectory record %s/%s@%s refused: %s", m.topic, m.partition, m.offset, exc)
        return
    for t in trajs:
        inflight = df.emitter.task(t.task_id)
        if inflight is not None and t.node_id:
            window.nodes[inflight.pool].add(t.node_id)
    df.ingest(trajs)


def _on_weights(df: Dataflow, policy: str, m: Any) -> None:
    obj = m.obj if isinstance(m.obj, dict) else {}
    version = obj.get("version", m.key)
    try:
        df.on_weights(policy, int(version))
    except (TypeError, ValueError):
        log.warning("weight announcement without a version on %s@%s: %r", m.topic, m.offset, m.obj)


def _on_metrics(df: Dataflow, m: Any, window: _Window) -> None:
    obj = m.obj
    if m.key == COMPONENT_ID or not isinstance(obj, dict):
        return
    if obj.get("component") == "trainer" and obj.get("event") == "skipped" and obj.get("reason") == "duplicate":
        df.batch_skipped(str(obj.get("policy")), str(obj.get("batch_id")))
        return
    if "wait_s" in obj and "step_s" in obj:
        window.wait_s += float(obj["wait_s"])
        window.step_s += float(obj["step_s"])
    if obj.get("pool") and obj.get("node_id"):
        window.nodes[obj["pool"]].add(obj["node_id"])


def _identity() -> dict[str, str]:
    """Fields of every metrics record (the metrics contract); ``kind`` tells the two records apart."""
    return {"component": "dataflow", "id": COMPONENT_ID}


def _publish_metrics(producer: Any, topic: str, df: Dataflow, now: float, handoff_ms: dict[str, dict]) -> None:
    producer.send_json(topic, COMPONENT_ID, {**_identity(), "kind": "dataflow", "time": now,
                                             "versions": dict(df.versions), "counters": df.counters(),
                                             "handoff_ms": handoff_ms})


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
        producer.send_json(topic, COMPONENT_ID, {**_identity(), **autoscale_report(section.autoscale, pools, now)})
    window.reset()


def _checkpoint(producer: Any, store: Any, key: str, df: Dataflow, offsets: dict, consumer: Any,
                uncommitted: list, placing: list[tuple[str, Any]], ids: dict[str, str | None],
                s3: OutageReport) -> None:
    producer.flush()  # batches/tasks derived from the state must be on the log before it is saved
    _record_positions(df, placing)  # after the flush every task record has its position
    state = {"dataflow": df.state_dict(), "offsets": [[t, p, o] for (t, p), o in offsets.items()], "topic_ids": ids}
    # A restarting S3 server is waited out (one line per backoff step), not a reason to exit.
    wait_out_outage(lambda: store.put_json(key, state), s3)
    consumer.commit(uncommitted)
    uncommitted.clear()


def _record_positions(df: Dataflow, placing: list[tuple[str, Any]]) -> None:
    """Move the acknowledged task records' positions into the in-flight table (kept in ``placing``:
    those not acknowledged yet). A record the broker refused ends the process (:class:`TaskNotWritten`):
    kafka-python's producer stays failed after a fatal broker error (seen when Tansu's storage, the
    bucket, restarted under it), so carrying on would leave the task in flight until it expires; the
    supervisor restarts the dataflow, which re-emits what it emitted after its last state save."""
    waiting = []
    for prompt_id, fut in placing:
        if not fut.done():
            waiting.append((prompt_id, fut))
        elif fut.exception() is not None:
            raise TaskNotWritten(f"task {prompt_id} was not written to the log: {fut.exception()}")
        else:
            ack = fut.result()
            df.emitter.placed(prompt_id, (ack.topic, ack.partition, ack.offset))
    placing[:] = waiting


class TaskNotWritten(RuntimeError):
    """The broker refused a task record: the dataflow exits to be restarted with a fresh producer."""


def _latest_version(cfg: ClusterConfig, policy: str) -> int | None:
    """The newest weight version in the bucket (the source of truth when announcements were lost)."""
    from astraflow.delta.store import WeightStore

    return WeightStore.from_config(cfg, policy).latest_version()
