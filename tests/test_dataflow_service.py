"""The dataflow process against the real broker and bucket: dedup, staleness, resume."""

from __future__ import annotations

import threading
import time

import pytest
from dataflow_helpers import run_dataflow
from fakes import make_trajectory

from astraflow.dataflow import DataflowConfig
from astraflow.dataflow.service import STATE_OBJECT
from astraflow.records import Task, Trajectory, batch, task, trajectory
from astraflow.records.control import DataflowCounters, WeightAnnouncement, send_control

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _counters(m) -> dict[str, int] | None:
    """The dataflow's counters, when ``m`` is its counters record (typed at decode); None otherwise."""
    return m.record.counters if isinstance(m.record, DataflowCounters) else None


def traj(prompt_id: str, i: int, version: int, reward: float) -> Trajectory:
    return make_trajectory(prompt_id, "solver", i, n=2, version=version, reward=reward, prompt_ids=[1],
                           response_ids=[7, 8], logprobs=[-0.5, -0.25], node_id="node-1")


def announce_version(prod, topic: str, version: int, batch_id: str | None = None):
    """Announce ``version`` of policy ``solver`` as the trainer's publisher does (a typed announcement);
    returns the acknowledgement."""
    record = WeightAnnouncement(version=version, policy="solver", kind="delta", bytes=0, checksum="test",
                                manifest=f"weights/solver/v{version:08d}/manifest.json", batch_id=batch_id)
    return send_control(prod, topic, str(version), record, policy="solver")


def start(cfg, section, dataset, **options):
    stop = threading.Event()
    result: dict = {}

    def body():
        result["counters"] = run_dataflow(cfg, section, stop, dataset=dataset, checkpoint_every_s=0.5,
                                          metrics_every_s=0.2, **options)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return stop, th, result


def read_until(consumer, want: int, timeout_s: float = 30.0, pred=lambda m: True) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += [m for m in consumer.poll(timeout_s=0.3) if pred(m)]
    return got


def read_tasks(consumer, want: int, timeout_s: float = 30.0) -> list[str]:
    """Prompt ids of the task rows read until ``want`` of them came (a record may hold several)."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += [t.prompt_id for m in consumer.poll(timeout_s=0.3) for t in task.from_table(m.table)]
    return got


def test_duplicate_trained_once_stale_dropped_and_resume(test_cluster):
    from astraflow.log import LogConsumer, LogProducer, Topics
    from astraflow.objstore import ObjectStore, RunLayout

    cfg, topics = test_cluster, Topics(test_cluster.run)
    # max_in_flight: the plain cap; no trainer consumes the batches here (the default staleness
    # bound would rightly hold p2 back until a version is announced for the queued batches)
    section = DataflowConfig(policies=["solver"], groups_per_batch=1, max_staleness=1, min_group_samples=1,
                             epochs=1, max_in_flight=2)
    dataset = [Task(f"p{i}", f"q{i}", answer=str(i), samples=2) for i in range(3)]
    stop, th, result = start(cfg, section, dataset)
    prod = LogProducer(cfg, "test-raas")
    tasks_c = LogConsumer(cfg, topics.tasks("default"), "test-raas")
    metrics_c = LogConsumer(cfg, topics.metrics, "test-metrics")
    batches_c = LogConsumer(cfg, topics.batches("solver"), "test-trainer")
    try:
        assert sorted(read_tasks(tasks_c, 2)) == ["p0", "p1"]  # cap = 1 x (1+1)
        announce_version(prod, topics.weights("solver"), 3).result(10)
        seen_v3 = read_until(metrics_c, 1, pred=lambda m: _counters(m) is not None and m.record.versions.get("solver") == 3)
        assert seen_v3, "dataflow never saw the weight announcement"
        # the metrics contract: component and id on every record, kind names the dataflow's record
        assert {k: seen_v3[0].obj[k] for k in ("component", "id", "kind")} == {
            "component": "dataflow", "id": "dataflow", "kind": "dataflow"}

        def send(trajs):
            prod.send_table(topics.trajectories, trajs[0].episode_id, trajectory.to_table(trajs),
                            trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)

        send([traj("p0", 0, 3, 1.0)])
        send([traj("p0", 0, 3, 1.0)])  # redelivered duplicate
        send([traj("p0", 1, 2, 0.0)])
        send([traj("p1", 0, 1, 1.0)])  # 3 - 1 > 1: stale
        send([traj("p1", 1, 3, 0.0)])
        bmsgs = read_until(batches_c, 2)
        got = {b.batch_id: b for b in (batch.from_table(m.table) for m in bmsgs)}
        assert sorted(got) == ["solver-00000000", "solver-00000001"]
        eps = sorted(t.episode_id for b in got.values() for t in b.trajectories)
        assert eps == ["p0/solver/0", "p0/solver/1", "p1/solver/1"]  # duplicate once, stale gone
        assert all(b.trainer_version == 3 for b in got.values())
        assert read_tasks(tasks_c, 1) == ["p2"]
    finally:
        stop.set()
        th.join(30)
    c = result["counters"]
    assert c["trajectories.duplicate"] == 1 and c["trajectories.stale"] == 1
    assert c["trajectories.kept"] == 3 and c["tasks.in_flight"] == 1
    store = ObjectStore.from_config(cfg)
    assert store.exists(RunLayout(cfg.run).dataflow_key(STATE_OBJECT))

    # Restart: state and offsets come back; p2 (in flight at the stop) is still owed a batch.
    stop, th, result = start(cfg, section, dataset)
    try:
        prod.send_table(topics.trajectories, "x", trajectory.to_table([traj("p2", 0, 3, 1.0), traj("p2", 1, 3, 0.0),
                                                                        traj("p0", 1, 2, 0.0)]),
                        trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)
        (m,) = read_until(batches_c, 1)
        b = batch.from_table(m.table)
        assert b.batch_id == "solver-00000002" and [t.task_id for t in b.trajectories] == ["p2", "p2"]
    finally:
        stop.set()
        th.join(30)
        for c_ in (tasks_c, metrics_c, batches_c):
            c_.close()
        prod.close()
    c = result["counters"]
    assert c["trajectories.duplicate"] == 2  # the re-sent p0 sample, remembered across the restart
    assert c["trajectories.stale"] == 1 and c["tasks.finished"] == 3 and c["tasks.in_flight"] == 0
    assert c["tasks.reemitted_lost"] == 0  # the same log: p2's record is still there, nothing re-emitted


def _delete_run_topics(cfg) -> list[str]:
    """Lose the log of ``cfg.run``: what an in-memory broker restart does to a run's topics."""
    from astraflow.log.admin import open_admin

    admin = open_admin(cfg)
    try:
        names = [t for t in admin.list_topics() if t.startswith(f"{cfg.run}.")]
        admin.delete_topics(names)
    finally:
        admin.close()
    return names


def test_resume_onto_a_lost_log_reemits_in_flight_tasks_at_once(test_cluster, unique_name):
    """The dataflow's bucket state survives, its topics do not: the in-flight tasks are re-emitted
    within seconds (not after task_timeout_s), counted, and records of the new topics below the old
    checkpointed offsets are read, not skipped."""
    from astraflow.log import LogConsumer, LogProducer, Topics

    cfg, topics = test_cluster, Topics(test_cluster.run)
    section = DataflowConfig(policies=["solver"], groups_per_batch=1, max_staleness=1, min_group_samples=1,
                             epochs=1, max_in_flight=2, task_timeout_s=900)
    dataset = [Task(f"p{i}", f"q{i}", answer=str(i), samples=2) for i in range(4)]
    stop, th, result = start(cfg, section, dataset)
    prod = LogProducer(cfg, "test-raas")
    try:
        with LogConsumer(cfg, topics.tasks("default"), unique_name("raas")) as tasks_c:
            assert sorted(read_tasks(tasks_c, 2)) == ["p0", "p1"]
        for i in range(3):  # trajectories offsets 0..2 in the old log: the checkpoint will skip below 3
            prod.send_table(topics.trajectories, f"x{i}", trajectory.to_table([traj("zz", i, 0, 1.0)]),
                            trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)
        # Wait until the dataflow has read them (its metrics say so), not a fixed time: on a loaded
        # machine its poll can come later than any sleep chosen here.
        with LogConsumer(cfg, topics.metrics, unique_name("metrics")) as metrics_c:
            assert read_until(metrics_c, 1, pred=lambda m: (_counters(m) or {}).get(
                "trajectories.unknown_task") == 3), "the dataflow did not read the 3 trajectories"
        time.sleep(1.0)  # a checkpoint (every 0.5 s) after they were read
    finally:
        stop.set()
        th.join(30)
    assert result["counters"]["tasks.in_flight"] == 2 and result["counters"]["trajectories.unknown_task"] == 3

    deleted = _delete_run_topics(cfg)
    assert topics.tasks("default") in deleted and topics.trajectories in deleted

    t0 = time.monotonic()
    stop, th, result = start(cfg, section, dataset)
    try:
        with LogConsumer(cfg, topics.tasks("default"), unique_name("raas")) as tasks_c:
            again = read_tasks(tasks_c, 2, timeout_s=30)
            reemit_s = time.monotonic() - t0
            assert sorted(again) == ["p0", "p1"]
        # offset 0 of the new trajectories topic is read although the checkpoint said "skip below 3"
        prod.send_table(topics.trajectories, "p0", trajectory.to_table([traj("p0", 0, 0, 1.0), traj("p0", 1, 0, 0.0)]),
                        trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)
        with LogConsumer(cfg, topics.batches("solver"), unique_name("trainer")) as batches_c:
            (m,) = read_until(batches_c, 1)
        assert [t.task_id for t in batch.from_table(m.table).trajectories] == ["p0", "p0"]
    finally:
        stop.set()
        th.join(30)
        prod.close()
    c = result["counters"]
    print(f"re-emitted {c['tasks.reemitted_lost']} lost tasks {reemit_s:.2f} s after the restart")
    assert c["tasks.reemitted_lost"] == 2 and c["tasks.expired"] == 0
    assert reemit_s < 20, reemit_s  # start-up included; task_timeout_s is 900 s
    assert c["tasks.finished"] == 1 and c["trajectories.kept"] == 2


def test_a_restart_adopts_the_tasks_and_batches_its_lost_life_sent_after_its_last_save(test_cluster, unique_name):
    """A dataflow killed between two state saves has sent a task and a batch the saved state does not
    know; a node runs the task and the trainer trains the batch. Its next life reads both back from the
    log: the task's trajectories are trained (not dropped as unknown_task) and its prompt is not drawn
    again; the batch's trajectories, read again, are not received twice (the adoption counted them:
    the log holds them once), and the next batch gets the next id (not the trained batch's id, which the
    trainer would skip)."""
    from astraflow.log import LogConsumer, LogProducer, Topics
    from astraflow.log.range_reader import read_to_end
    from astraflow.objstore import ObjectStore, RunLayout
    from astraflow.objstore.errors import ObjectNotFoundError

    cfg, topics = test_cluster, Topics(test_cluster.run)
    store, key = ObjectStore.from_config(cfg), RunLayout(cfg.run).dataflow_key(STATE_OBJECT)
    section = DataflowConfig(policies=["solver"], groups_per_batch=1, max_staleness=1, min_group_samples=1,
                             epochs=1, max_in_flight=2, task_timeout_s=900)
    dataset = [Task(f"p{i}", f"q{i}", answer=str(i), samples=2) for i in range(5)]

    def saved_in_flight() -> list[str]:
        try:
            return sorted(f["task"]["prompt_id"] for f in store.get_json(key)["dataflow"]["emitter"]["in_flight"])
        except ObjectNotFoundError:
            return []

    def send(prompt_id: str) -> None:
        prod.send_table(topics.trajectories, prompt_id,
                        trajectory.to_table([traj(prompt_id, 0, 0, 1.0), traj(prompt_id, 1, 0, 0.0)]),
                        trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)

    def batches_on_the_log(want: int) -> list[tuple[str, str]]:
        """(batch id, task id) of every batch record on the topic, once there are ``want`` of them (read
        outside any group: what a trainer will see, whatever a test consumer re-read)."""
        deadline = time.monotonic() + 30
        while True:
            got = read_to_end(cfg, {(topics.batches("solver"), 0): 0}).messages
            if len(got) >= want or time.monotonic() > deadline:
                break
        return [(b.batch_id, b.trajectories[0].task_id) for b in (batch.from_table(m.table) for m in got)]

    prod = LogProducer(cfg, "test-raas")
    tasks_c = LogConsumer(cfg, topics.tasks("default"), unique_name("raas"))
    stop, th, result = start(cfg, section, dataset)
    try:
        assert sorted(read_tasks(tasks_c, 2)) == ["p0", "p1"]
        deadline = time.monotonic() + 30
        while saved_in_flight() != ["p0", "p1"] and time.monotonic() < deadline:
            time.sleep(0.2)
        last_save = store.get_json(key)  # the save the lost life will have made last
        send("p0")  # finishes p0: the dataflow serves its batch and emits p2, which that save does not know
        assert batches_on_the_log(1) == [("solver-00000000", "p0")]
        assert read_tasks(tasks_c, 1) == ["p2"]
    finally:
        stop.set()
        th.join(30)
    # As if the dataflow had been killed before it saved again: its later saves never happened.
    store.put_json(key, last_save)

    stop, th, result = start(cfg, section, dataset)
    try:
        # p0's trajectories again: a killed life would not have committed them (here the clean stop did)
        send("p0")
        send("p2")  # the node's work on the task the lost life sent
        # p2's batch gets the next id, and p0's is not made again
        assert batches_on_the_log(2) == [("solver-00000000", "p0"), ("solver-00000001", "p2")]
        # p0 and p2 finished, p1 in flight: the next task is p3 (p2 is not drawn again)
        assert read_tasks(tasks_c, 1) == ["p3"]
    finally:
        stop.set()
        th.join(30)
        tasks_c.close()
        prod.close()
    assert batches_on_the_log(2) == [("solver-00000000", "p0"), ("solver-00000001", "p2")]  # nothing more
    c = result["counters"]
    assert c["tasks.adopted"] == 1 and c.get("trajectories.unknown_task", 0) == 0
    assert c["trajectories.adopted_read_again"] == 2 and c.get("trajectories.duplicate", 0) == 0
    assert c["trajectories.kept"] == 4 and c["batches.solver.batches"] == 2
    assert c["tasks.finished"] == 2 and c["tasks.in_flight"] == 2  # p0 and p2; p1 and p3
    assert c["tasks.emitted"] == c["tasks.finished"] + c["tasks.in_flight"]
    assert c["trajectories.received"] == c["trajectories.kept"]


def test_an_announcement_naming_its_last_batch_holds_emission_back_after_a_trainer_restart(test_cluster,
                                                                                          unique_name):
    """A trainer resumed from a checkpoint older than its lost life republishes it as a fresh version and
    trains the batches after it again. The announcement names the last batch in those weights, and the
    dataflow counts staleness from it as the version arrives: the fresh version numbers open no room for
    tasks the trainer will not reach in time (counted by the versions alone, it emits one task more at
    each of the last two announcements)."""
    from astraflow.log import LogConsumer, LogProducer, Topics

    cfg, topics = test_cluster, Topics(test_cluster.run)
    section = DataflowConfig(policies=["solver"], groups_per_batch=1, max_staleness=3, min_group_samples=1,
                             epochs=1, emit_ahead=False, task_timeout_s=900)
    dataset = [Task(f"p{i}", f"q{i}", answer=str(i), samples=2) for i in range(12)]
    prod = LogProducer(cfg, "test-trainer")
    tasks_c = LogConsumer(cfg, topics.tasks("default"), unique_name("raas"))
    metrics_c = LogConsumer(cfg, topics.metrics, unique_name("metrics"))

    def finish(prompt_id: str, version: int) -> None:
        prod.send_table(topics.trajectories, prompt_id,
                        trajectory.to_table([traj(prompt_id, 0, version, 1.0), traj(prompt_id, 1, version, 0.0)]),
                        trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)

    def batches_made(n: int) -> None:
        """Wait until the dataflow made ``n`` batches: its trajectories and an announcement sent after them
        are on different topics, and it may read the announcement first."""
        made = read_until(metrics_c, 1, pred=lambda m: (_counters(m) or {}).get("batches.solver.batches", 0) >= n)
        assert made, f"the dataflow never made {n} batches"

    def announce(version: int, batch_id: str) -> int:
        """Announce ``version`` as trained through ``batch_id``; the tasks emitted once the dataflow read it."""
        announce_version(prod, topics.weights("solver"), version, batch_id).result(10)
        # the dataflow emits in the loop pass that reads the announcement, before its next metrics record
        seen = read_until(metrics_c, 1, pred=lambda m: _counters(m) is not None
                          and m.record.versions.get("solver") == version)
        assert seen, f"the dataflow never read v{version}'s announcement"
        return seen[0].record.counters["tasks.emitted"]

    stop, th, result = start(cfg, section, dataset)
    try:
        assert sorted(read_tasks(tasks_c, 4)) == ["p0", "p1", "p2", "p3"]  # (max_staleness + 1) x groups_per_batch
        finish("p0", 0)  # batch 0
        finish("p1", 0)  # batch 1
        batches_made(2)
        assert announce(1, "solver-00000000") == 5
        assert announce(2, "solver-00000001") == 6
        assert sorted(read_tasks(tasks_c, 2)) == ["p4", "p5"]
        # The trainer dies after v2 and resumes from its checkpoint after batch 0, republished as v3; it
        # trains batch 1 again into v4, and the batches after it into v5 and on.
        assert announce(3, "solver-00000000") == 6
        finish("p4", 2)  # batch 2: trained by v4 (3 versions after its tokens' v2 at most: kept)
        batches_made(3)
        assert announce(4, "solver-00000001") == 6  # 7 by the versions alone
        finish("p5", 2)  # batch 3
        batches_made(4)
        assert announce(5, "solver-00000002") == 7  # 8 by the versions alone
        assert read_tasks(tasks_c, 2, timeout_s=3) == ["p6"]
    finally:
        stop.set()
        th.join(30)
        tasks_c.close()
        metrics_c.close()
        prod.close()
    c = result["counters"]
    assert c["tasks.emitted"] == 7 and c["batches.solver.batches"] == 4 and c.get("trajectories.stale", 0) == 0


def test_told_the_trainers_step_count_the_dataflow_emits_nothing_for_after_the_last_step(test_cluster, unique_name):
    """``train_steps`` (the recipe's ``trainer.steps``, passed by ``astraflow run``): once the run's last
    batch is served, a new version opens no room: the tasks emitted are its batch's and one batch's worth
    of spares (by the versions alone, the announcement would let one more out)."""
    from astraflow.log import LogConsumer, LogProducer, Topics

    cfg, topics = test_cluster, Topics(test_cluster.run)
    section = DataflowConfig(policies=["solver"], groups_per_batch=1, max_staleness=1, min_group_samples=1,
                             epochs=1, emit_ahead=False, task_timeout_s=900)
    dataset = [Task(f"p{i}", f"q{i}", answer=str(i), samples=2) for i in range(8)]
    prod = LogProducer(cfg, "test-raas")
    tasks_c = LogConsumer(cfg, topics.tasks("default"), unique_name("raas"))
    metrics_c = LogConsumer(cfg, topics.metrics, unique_name("metrics"))
    stop, th, result = start(cfg, section, dataset, train_steps=1)
    try:
        assert sorted(read_tasks(tasks_c, 2)) == ["p0", "p1"]  # the one batch's group and a spare
        prod.send_table(topics.trajectories, "p0", trajectory.to_table([traj("p0", 0, 0, 1.0), traj("p0", 1, 0, 0.0)]),
                        trajectory.SCHEMA_NAME, trajectory.SCHEMA_VERSION).result(10)
        announce_version(prod, topics.weights("solver"), 1, "solver-00000000").result(10)
        seen = read_until(metrics_c, 1, pred=lambda m: _counters(m) is not None and m.record.versions.get("solver") == 1
                          and m.record.counters.get("batches.solver.batches") == 1)
        assert seen and seen[0].record.counters["tasks.emitted"] == 2
        assert read_tasks(tasks_c, 1, timeout_s=2) == []
    finally:
        stop.set()
        th.join(30)
        tasks_c.close()
        metrics_c.close()
        prod.close()
    assert result["counters"]["tasks.emitted"] == 2 and result["counters"]["tasks.in_flight"] == 1


@pytest.mark.parametrize("launcher_partitions", [None, 6])
def test_tasks_emitted_together_share_a_record_per_partition_each_in_its_own_keys_partition(
        test_cluster, unique_name, launcher_partitions):
    """The dataflow sends the tasks it emits at once as one record per partition, and each task lands in
    the partition kafka's default partitioner gives its prompt id: the nodes get the same tasks as with
    a record per task, in fewer records. The partition count is the topic's: the dataflow's default (4)
    when it creates the topic, the launcher's when a pool of 6 nodes had it created with 6 (grouped by 4,
    partitions 4 and 5 would get tasks of other keys and two of the six nodes none of their own)."""
    from astraflow.log import LogConsumer, LogProducer, Topics, ensure_topics
    from astraflow.log.producer import key_partition

    cfg, topics = test_cluster, Topics(test_cluster.run)
    if launcher_partitions is not None:
        ensure_topics(cfg, {topics.tasks("default"): launcher_partitions})
    count = launcher_partitions or 4
    section = DataflowConfig(policies=["solver"], groups_per_batch=12, max_staleness=0, min_group_samples=1,
                             epochs=1, max_in_flight=12)
    dataset = [Task(f"prompt-{i}", f"q{i}", answer=str(i), samples=2) for i in range(12)]
    stop, th, _result = start(cfg, section, dataset)
    try:
        with LogConsumer(cfg, topics.tasks("default"), unique_name("raas")) as tasks_c:
            records, rows = [], 0
            deadline = time.monotonic() + 30
            while rows < 12 and time.monotonic() < deadline:
                for m in tasks_c.poll(timeout_s=0.3):
                    records.append((m.partition, [t.prompt_id for t in task.from_table(m.table)]))
                    rows += len(records[-1][1])
    finally:
        stop.set()
        th.join(30)
    assert sorted(p for _, ids in records for p in ids) == sorted(t.prompt_id for t in dataset)
    partitions = {p: key_partition(p, count) for _, ids in records for p in ids}
    assert all(partitions[p] == partition for partition, ids in records for p in ids)
    assert len(records) == len(set(partitions.values())) < 12  # one record per partition used
    assert max(partitions.values()) == count - 1  # every partition gets its own keys' tasks
    # key_partition is the producer's own choice: a record keyed by each prompt id lands there
    probe = unique_name("probe-topic")
    ensure_topics(cfg, {probe: count})
    with LogProducer(cfg, unique_name("probe")) as prod:
        acks = {p: prod.send_json(probe, p, {}).result(10) for p in partitions}
    assert {p: ack.partition for p, ack in acks.items()} == partitions


def test_a_refused_batch_record_ends_the_dataflow_to_be_restarted():
    """A batch the broker refused (its storage restarting) must not be taken as sent: the trainer would wait
    for it while the staleness bound holds every task back. Acknowledged ones are forgotten, pending kept."""
    from concurrent.futures import Future

    from astraflow.dataflow.service import RecordNotWritten, _check_batches_written
    from astraflow.log.errors import ProduceRefusedError

    acked, pending, refused = Future(), Future(), Future()
    acked.set_result(object())
    sending = [("b0", acked), ("b1", pending)]
    _check_batches_written(sending)
    assert [b for b, _ in sending] == ["b1"]
    refused.set_exception(ProduceRefusedError("UnknownError from the broker"))
    sending.append(("b2", refused))
    with pytest.raises(RecordNotWritten, match="batch b2 was not written"):
        _check_batches_written(sending)
