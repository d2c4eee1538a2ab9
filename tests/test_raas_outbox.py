"""The node's trajectory outbox: episodes finishing in one event-loop turn share one record, and each
episode returns only once that record is acknowledged. Units against a recording producer (when each
record is acknowledged, failures), then the same on the real embedded broker."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
from fakes import make_trajectory

from astraflow.log.errors import ProduceRefusedError
from astraflow.raas.outbox import TrajectoryOutbox
from astraflow.records import trajectory as traj_rec
from astraflow.records.schema import RecordSchemaError


def traj(task: str, i: int, **fields) -> traj_rec.Trajectory:
    base = {"episode_id": f"{task}#{i}", "group_id": task, "policy": "policy", "prompt_ids": [1, 2],
            "response_ids": [3, 4], "logprobs": [-0.1, -0.2]}
    return make_trajectory(task, i=i, n=2, version=0, **{**base, **fields})


class RecordingProducer:
    """Keeps what was sent; the test decides when (and how) each record is acknowledged."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[traj_rec.Trajectory], str | None]] = []
        self.acks: list[concurrent.futures.Future] = []

    def send_table(self, topic, key, table, schema_name, schema_version, policy=None):
        assert schema_name == traj_rec.SCHEMA_NAME
        self.sent.append((key, traj_rec.from_table(table), policy))
        ack: concurrent.futures.Future = concurrent.futures.Future()
        self.acks.append(ack)

        class _Ack:
            def as_concurrent_future(self):
                return ack
        return _Ack()


async def _tick() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_episodes_finishing_in_one_turn_share_a_record_and_each_waits_for_its_ack():
    async def body():
        producer = RecordingProducer()
        outbox = TrajectoryOutbox(producer, "run.trajectories")
        sends = [asyncio.ensure_future(outbox.send(f"t{k}", [traj(f"t{k}", 0), traj(f"t{k}", 1)])) for k in range(3)]
        await _tick()
        assert len(producer.sent) == 1
        key, rows, policy = producer.sent[0]
        assert key == "t0" and policy == "policy"
        assert [t.episode_id for t in rows] == ["t0#0", "t0#1", "t1#0", "t1#1", "t2#0", "t2#1"]
        assert not any(s.done() for s in sends)  # not acknowledged yet: no task may be committed
        producer.acks[0].set_result(None)
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        # an episode finishing later goes in a record of its own
        late = asyncio.ensure_future(outbox.send("t3", [traj("t3", 0, policy="other")]))
        await _tick()
        assert len(producer.sent) == 2 and producer.sent[1][2] == "other"
        producer.acks[1].set_result(None)
        await asyncio.wait_for(late, 5)
        assert outbox.records == 2

    asyncio.run(body())


def test_a_refused_record_fails_every_episode_in_it():
    async def body():
        producer = RecordingProducer()
        outbox = TrajectoryOutbox(producer, "run.trajectories")
        sends = [asyncio.ensure_future(outbox.send(f"t{k}", [traj(f"t{k}", 0)])) for k in range(2)]
        await _tick()
        producer.acks[0].set_exception(ProduceRefusedError("broker refused the record"))
        results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 5)
        assert all(isinstance(r, ProduceRefusedError) for r in results)

    asyncio.run(body())


def test_a_bad_episode_fails_alone():
    async def body():
        producer = RecordingProducer()
        outbox = TrajectoryOutbox(producer, "run.trajectories")
        good = asyncio.ensure_future(outbox.send("good", [traj("good", 0)]))
        invalid = asyncio.ensure_future(outbox.send("invalid", [traj("invalid", 0, logprobs=[-0.1])]))
        unbuildable = asyncio.ensure_future(outbox.send("unbuildable", [traj("unbuildable", 0, reward="high")]))
        await _tick()
        with pytest.raises(RecordSchemaError, match="logprobs has 1 entries"):
            await invalid  # refused before it was queued
        # the record of both queued episodes could not be built: each was sent on its own
        assert [[t.task_id for t in rows] for _, rows, _ in producer.sent] == [["good"]]
        for ack in producer.acks:
            ack.set_result(None)
        await asyncio.wait_for(good, 5)
        with pytest.raises(Exception, match="float|double|str"):
            await unbuildable

    asyncio.run(body())


@pytest.mark.integration
def test_on_the_real_broker_one_turns_episodes_are_one_acknowledged_record(test_cluster, unique_name):
    """Through a LogProducer on the embedded broker: three episodes queued in one turn come back as one
    record holding all their trajectories, and each send returned only after the broker acknowledged it."""
    from astraflow.log import LogConsumer, LogProducer, Topics, ensure_topics

    topic = Topics(test_cluster.run).trajectories
    ensure_topics(test_cluster, {topic: 1})
    producer = LogProducer(test_cluster, unique_name("node"))
    try:
        async def body():
            outbox = TrajectoryOutbox(producer, topic)
            await asyncio.wait_for(asyncio.gather(
                *(outbox.send(f"t{k}", [traj(f"t{k}", 0), traj(f"t{k}", 1)]) for k in range(3))), 30)
            return outbox.records

        assert asyncio.run(body()) == 1
    finally:
        producer.close()
    with LogConsumer(test_cluster, topic, unique_name("reader")) as reader:
        records, deadline = [], time.monotonic() + 30
        while not records and time.monotonic() < deadline:
            records = reader.poll(timeout_s=0.5)
        # what the sends awaited was acknowledged: it is on the log, one record, every trajectory in it
        assert [[t.episode_id for t in traj_rec.from_table(m.table)] for m in records] == [
            ["t0#0", "t0#1", "t1#0", "t1#1", "t2#0", "t2#1"]]
