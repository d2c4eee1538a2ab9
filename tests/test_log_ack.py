"""AckFuture answers as a concurrent.futures.Future of an Ack would, from kafka-python's own futures;
the producer's ledger counts acknowledged records nobody waited on (real broker)."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest
from kafka.errors import KafkaTimeoutError, NotLeaderForPartitionError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata
from kafka.structs import TopicPartition
from log_helpers import acked_count

from astraflow.config import ClusterConfig
from astraflow.log import LogProducer, Topics, ensure_topics
from astraflow.log.ack import AckFuture
from astraflow.log.errors import ProduceRefusedError
from astraflow.log.message import Ack

TOPIC = "run.trajectories"


def _record(partition: int = 1) -> tuple[FutureProduceResult, FutureRecordMetadata]:
    """kafka-python's futures of one record, batch index 2 of its produce request."""
    batch = FutureProduceResult(TopicPartition(TOPIC, partition))
    return batch, FutureRecordMetadata(batch, 2, 1_700_000_000_000, None, 2, 100, 40)


def test_an_acknowledged_record_resolves_to_where_it_landed_also_through_the_bridge():
    batch, sent = _record()
    ack = AckFuture(sent, "raas-1", TOPIC, 100, "claims/abc")
    early = ack.as_concurrent_future()  # bridged before the broker answers
    assert not ack.done() and not early.done()
    with pytest.raises(TimeoutError, match="raas-1.*run.trajectories"):
        ack.result(0.05)
    batch.success((40, -1, None))  # the batch landed at offset 40: this record at 42
    assert ack.done()
    expected = Ack(TOPIC, 1, 42, 100, "claims/abc")
    assert ack.result() == expected and ack.exception() is None
    assert early.result(1) == expected and ack.as_concurrent_future().result(0) == expected


@pytest.mark.parametrize("error", [NotLeaderForPartitionError(), KafkaTimeoutError("delivery timed out")],
                         ids=["refused", "expired"])
def test_a_refused_record_raises_produce_refused_naming_the_topic(error):
    batch, sent = _record()
    ack = AckFuture(sent, "raas-1", TOPIC, 100, None)
    bridge = ack.as_concurrent_future()
    batch.failure(error)
    # A record that expired in the producer is refused, not a wait that timed out.
    with pytest.raises(ProduceRefusedError, match="raas-1: run.trajectories did not acknowledge") as raised:
        ack.result(1)
    assert raised.value.__cause__ is error
    assert isinstance(ack.exception(), ProduceRefusedError)
    with pytest.raises(ProduceRefusedError):
        bridge.result(1)


def test_the_bridge_serves_asyncio():
    batch, sent = _record()
    ack = AckFuture(sent, "raas-1", TOPIC, 100, None)

    async def wait() -> Ack:
        pending = asyncio.wrap_future(ack.as_concurrent_future())
        asyncio.get_running_loop().call_later(0.05, batch.success, (7, -1, None))
        return await pending

    assert asyncio.run(wait()).offset == 9


def test_the_ledger_counts_acknowledged_records_nobody_waited_on(test_cluster: ClusterConfig):
    topic = Topics(test_cluster.run).trajectories
    ensure_topics(test_cluster, {topic: 2})
    table = pa.table({"x": [1, 2, 3]})
    with LogProducer(test_cluster, "raas-1") as producer:
        sent = [producer.send_table(topic, f"k{i}", table, "trajectory", 1) for i in range(9)]
        producer.flush(20)
        landed = [a.result(0) for a in sent]
        assert acked_count(producer.ledger) == {
            (topic, p): sum(1 for a in landed if a.partition == p) for p in {a.partition for a in landed}}
        assert producer.ledger.produced_end() == {
            (topic, p): max(a.offset for a in landed if a.partition == p) + 1 for p in {a.partition for a in landed}}
