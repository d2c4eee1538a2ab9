"""Typed control records (astraflow.records.control) on the real broker: each model goes through the log
under its own schema name with its JSON keys unchanged, and a record that claims a control schema but
does not parse is dead-lettered by the consumer instead of being acted on (here: by the dataflow)."""

from __future__ import annotations

import math
import threading
import time

import pytest
from control_records_factory import autoscale_report, dataflow_counters, node_status
from dataflow_helpers import run_dataflow
from fakes import make_trajectory

from astraflow.dataflow import DataflowConfig
from astraflow.log import ConsumerGroups, LogConsumer, LogProducer, Topics, ensure_topics
from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA
from astraflow.records import Task, Trajectory, batch, trajectory
from astraflow.records.control import (
    METRICS_TOPIC_SCHEMAS,
    AutoscaleReport,
    ControlRecordError,
    DataflowCounters,
    LogRecordsDropped,
    LostRange,
    NodeStatus,
    TrainerCheckpointRefused,
    TrainerDone,
    TrainerSkipped,
    TrainerStart,
    TrainerStep,
    WeightAnnouncement,
    parse_control,
    send_control,
)

IDENTITY = {"id": "trainer.solver", "time": 1.5, "policy": "solver", "life": "abcd1234"}
STEP_FIELDS = {
    "step": 3, "version": 3, "batch_id": "solver-00000002", "loss": 0.25, "reward_mean": 0.5,
    "staleness_mean": 0.5, "staleness_max": 1, "wait_s": 0.2, "step_s": 1.25, "trajectories": 8, "tokens": 96,
    "grad_norm": 0.75, "handoff_ms": {"run.batches.solver": {"n": 1, "p50": 3.0, "p99": 3.0, "max": 3.0,
                                                              "samples": [3.0]}},
    "zero_adv_frac": 0.25, "trained_trajectories": 6.0, "state_copy_s": 0.01, "publish_blocked_s": 0.0,
    "publish_bytes": 1234, "publish_kind": "delta", "publish_s": None, "weights_gc_deleted": 0,
    "checkpoints_deleted": 1,
}
RECORDS = [
    TrainerStart(**IDENTITY, step=0, version=0, origin="seeded model, published as v0",
                 warm_start={"sft_steps": 2, "sft_final_loss": 1.5}),
    TrainerStep(**IDENTITY, **STEP_FIELDS),
    TrainerSkipped(**IDENTITY, reason="duplicate", batch_id="solver-00000001", step=3, version=3),
    TrainerDone(**IDENTITY, step=4, version=4, skipped={"duplicate": 1, "already_checkpointed": 0, "invalid": 0}),
    TrainerCheckpointRefused(**IDENTITY, step=0, refused_step=4, fallback_step=2,
                             error="trainer checkpoint step 4: run/trainer/solver/step-00000004/x does not match"),
    node_status("raas-default-0", versions={"solver": 3}, workflow={"tool_calls": 2},
                counters={"weights.refused.checksum": 1}),
    dataflow_counters({"tasks.emitted": 9, "trajectories.dropped.stale": 2}, versions={"solver": 3}),
    autoscale_report(default=(1, 2)),
    LogRecordsDropped(component="dataflow", time=2.5, topic="run.trajectories", partition=0, log_start=28,
                      stored_end=39, max_held_records=10, lost=[LostRange(group="run.archive", first=5, last=27)]),
]
WIRE_KEYS = {
    # the keys the trainer's dict records had before they were typed (metrics.jsonl readers use them)
    TrainerStart: {"component", *IDENTITY, "event", "step", "version", "origin", "warm_start"},
    TrainerStep: {"component", *IDENTITY, *STEP_FIELDS},
    TrainerSkipped: {"component", *IDENTITY, "event", "reason", "batch_id", "step", "version"},
    TrainerDone: {"component", *IDENTITY, "event", "step", "version", "skipped"},
    TrainerCheckpointRefused: {"component", *IDENTITY, "event", "step", "refused_step", "error", "fallback_step"},
    # a node's, the dataflow's counters and its report: the keys of the dicts they were
    NodeStatus: {"component", "id", "time", "node_id", "pool", "episodes", "rejected", "trajectories", "tokens",
                 "tokens_per_s", "versions", "busy_fraction", "refresh_s", "in_flight", "workflow", "counters",
                 "handoff_ms"},
    DataflowCounters: {"component", "id", "kind", "time", "versions", "counters", "handoff_ms"},
    AutoscaleReport: {"component", "id", "kind", "time", "pools"},
    LogRecordsDropped: {"component", "kind", "event", "time", "topic", "partition", "log_start", "stored_end",
                        "max_held_records", "lost"},
}


def test_parse_control_refuses_an_unknown_schema_and_a_bad_document_with_one_error():
    with pytest.raises(ControlRecordError, match="no control record has schema 'trainer-step' v2"):
        parse_control("trainer-step", 2, RECORDS[1].to_json())
    with pytest.raises(ControlRecordError, match="batch_id: Field required") as bad:
        parse_control("trainer-skipped", 1, {**IDENTITY, "reason": "duplicate", "step": 1, "version": 1})
    assert bad.value.reason == "bad-control-record"
    # optional fields left out of the JSON when absent, as the dict records did; a NaN loss stays NaN
    start = TrainerStart(**IDENTITY, step=0, version=0, origin="weight store version 0")
    assert "warm_start" not in start.to_json()
    bare = {k: v for k, v in STEP_FIELDS.items() if k not in ("zero_adv_frac", "trained_trajectories")}
    step = TrainerStep(**IDENTITY, **{**bare, "loss": float("nan")}).to_json()
    assert "zero_adv_frac" not in step and step["publish_s"] is None and math.isnan(step["loss"])


@pytest.mark.integration
def test_every_control_record_round_trips_through_the_log_under_its_own_schema(test_cluster, unique_name):
    topics = Topics(test_cluster.run)
    ensure_topics(test_cluster, {topics.metrics: 1, topics.weights("solver"): 1})
    announcement = WeightAnnouncement(version=4, policy="solver", kind="anchor", bytes=10, checksum="c0ffee",
                                      manifest="run/weights/solver/v00000004/manifest.json",
                                      batch_id="solver-00000003")
    with LogProducer(test_cluster, "test-trainer") as producer:
        for record in RECORDS:
            send_control(producer, topics.metrics, "trainer.solver", record).result(10)
        producer.send_json(topics.metrics, "node-a", {"component": "raas", "pool": "default"}).result(10)
        send_control(producer, topics.weights("solver"), "4", announcement, policy="solver").result(10)
    expected = {topics.metrics: METRICS_TOPIC_SCHEMAS, topics.weights("solver"): WEIGHT_ANNOUNCEMENT_SCHEMA}
    with LogConsumer(test_cluster, [topics.metrics, topics.weights("solver")], unique_name("reader"),
                     expected) as consumer:
        got, deadline = [], time.monotonic() + 30
        while len(got) < len(RECORDS) + 2 and time.monotonic() < deadline:
            got += consumer.poll(timeout_s=0.5)
    metrics = sorted((m for m in got if m.topic == topics.metrics), key=lambda m: m.offset)
    assert [(m.headers["schema"], m.schema_version) for m in metrics] == [
        *((type(r).SCHEMA_NAME, 1) for r in RECORDS), ("json", 1)]
    for m, record in zip(metrics, RECORDS, strict=False):
        assert set(m.obj) == WIRE_KEYS[type(record)]
        assert parse_control(m.schema_name, m.schema_version, m.obj) == record
    assert metrics[-1].obj == {"component": "raas", "pool": "default"}  # untyped metrics still read
    (weights,) = [m for m in got if m.topic == topics.weights("solver")]
    assert weights.headers["schema"] == "weight-announcement" and weights.policy == "solver"
    assert parse_control(weights.schema_name, weights.schema_version, weights.obj) == announcement


def _traj(prompt_id: str, i: int, reward: float) -> Trajectory:
    return make_trajectory(prompt_id, "solver", i, n=2, version=0, reward=reward, prompt_ids=[1],
                           response_ids=[7, 8], logprobs=[-0.5, -0.25], node_id="node-1")


def _poll_until(consumer: LogConsumer, pred, timeout_s: float = 30.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while not got and time.monotonic() < deadline:
        got = [m for m in consumer.poll(timeout_s=0.3) if pred(m)]
    return got


@pytest.mark.integration
@pytest.mark.slow
def test_a_malformed_skip_record_is_dead_lettered_by_the_dataflow_and_not_acted_on(test_cluster, unique_name):
    """The dataflow serves a batch; then three skip records for it reach the metrics topic: one without a
    batch id, one with the batch's id but a reason no trainer writes (a lenient reader would count it),
    and a good one. Only the good one counts; the other two are in the dead letters with their reason."""
    cfg, topics = test_cluster, Topics(test_cluster.run)
    section = DataflowConfig(policies=["solver"], groups_per_batch=1, max_staleness=1, min_group_samples=1,
                             epochs=1, max_in_flight=2)
    stop, result = threading.Event(), {}

    def body() -> None:
        result["counters"] = run_dataflow(cfg, section, stop, dataset=[Task("p0", "q0", answer="0", samples=2)],
                                          checkpoint_every_s=0.5, metrics_every_s=0.2)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    producer = LogProducer(cfg, "test-trainer")
    batches_c = LogConsumer(cfg, topics.batches("solver"), unique_name("trainer"))
    metrics_c = LogConsumer(cfg, topics.metrics, unique_name("metrics"))
    try:
        producer.send_table(topics.trajectories, "p0", trajectory.to_table([_traj("p0", 0, 1.0), _traj("p0", 1, 0.0)]),
                            trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)
        served = _poll_until(batches_c, lambda m: m.table is not None)
        assert served, "the dataflow served no batch"
        batch_id = batch.from_table(served[0].table).batch_id
        skip = TrainerSkipped(**IDENTITY, reason="duplicate", batch_id=batch_id, step=0, version=0).to_json()
        no_id = {k: v for k, v in skip.items() if k != "batch_id"}
        for obj in (no_id, {**skip, "reason": "bored"}, skip):
            producer.send_json(topics.metrics, "trainer.solver", obj, TrainerSkipped.SCHEMA_NAME,
                               TrainerSkipped.SCHEMA_VERSION).result(10)
        # the good record is the last on the topic's one partition: once it counts, the others were read
        counted = _poll_until(metrics_c, lambda m: m.key == "dataflow" and isinstance(m.record, DataflowCounters)
                              and m.record.counters.get("batches.solver.skipped_by_trainer", 0) >= 1)
        assert counted and counted[0].record.counters["batches.solver.skipped_by_trainer"] == 1
    finally:
        stop.set()
        thread.join(30)
        for closing in (batches_c, metrics_c, producer):
            closing.close()
    assert result["counters"]["batches.solver.skipped_by_trainer"] == 1
    with LogConsumer(cfg, topics.dead_letters, unique_name("dead-letters")) as dl:
        letters, deadline = [], time.monotonic() + 30
        while len(letters) < 2 and time.monotonic() < deadline:
            letters += [m for m in dl.poll(timeout_s=0.5)
                        if m.headers.get("dead-letter-group") == ConsumerGroups(cfg.run).dataflow]
    letters.sort(key=lambda m: int(m.headers["dead-letter-source-offset"]))
    assert [m.headers["dead-letter-reason"] for m in letters] == ["bad-control-record"] * 2
    assert "batch_id: Field required" in letters[0].headers["dead-letter-error"]
    assert "reason: Input should be 'duplicate' or 'invalid'" in letters[1].headers["dead-letter-error"]
    assert all(m.headers["schema"] == "trainer-skipped" for m in letters)
