"""UntilAcked sends a refused record again, forgets acknowledged ones, and settle() waits for them all.

The producer here hands out kafka-python's own futures, resolved by the test, so that a refusal can be
chosen; the whole-run check is benchmarks/chaos.py (its ``steps_without_record`` after bucket kills)."""

from __future__ import annotations

import threading

from kafka.errors import UnknownError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata
from kafka.structs import TopicPartition

from astraflow.log.ack import AckFuture
from astraflow.log.until_acked import UntilAcked

TOPIC = "run.metrics"


class _Producer:
    """send_json answers with a pending acknowledgement; the test settles each one."""

    def __init__(self) -> None:
        self.sent: list[tuple[dict, FutureProduceResult]] = []

    def send_json(self, topic: str, key: str, obj: dict) -> AckFuture:
        batch = FutureProduceResult(TopicPartition(topic, 0))
        self.sent.append((obj, batch))
        return AckFuture(FutureRecordMetadata(batch, 0, 0, None, 1, 10, 0), "trainer", topic, 10, None)


def test_a_refused_record_is_sent_again_until_acknowledged():
    producer = _Producer()
    records = UntilAcked(producer)
    records.send_json(TOPIC, "trainer", {"step": 1})
    records.send_json(TOPIC, "trainer", {"step": 2})
    producer.sent[0][1].failure(UnknownError())  # step 1 refused (the broker's storage restarting)
    producer.sent[1][1].success((5, -1, None))
    assert records.resend_refused() == 1
    assert [obj for obj, _ in producer.sent] == [{"step": 1}, {"step": 2}, {"step": 1}]
    assert records.resent == 1
    producer.sent[2][1].failure(UnknownError())  # refused again: sent a third time
    assert records.resend_refused() == 1 and len(producer.sent) == 4
    producer.sent[3][1].success((6, -1, None))
    assert records.resend_refused() == 0 and records.resent == 2


def test_settle_waits_for_late_acknowledgements_and_gives_up_at_its_deadline():
    producer = _Producer()
    records = UntilAcked(producer)
    records.send_json(TOPIC, "trainer", {"event": "done"})
    threading.Timer(0.1, producer.sent[0][1].failure, (UnknownError(),)).start()

    def acknowledge_the_resend() -> None:
        while len(producer.sent) < 2:
            threading.Event().wait(0.01)
        producer.sent[1][1].success((9, -1, None))

    threading.Thread(target=acknowledge_the_resend, daemon=True).start()
    assert records.settle(5) is True
    assert len(producer.sent) == 2
    records.send_json(TOPIC, "trainer", {"event": "never answered"})
    assert records.settle(0.3) is False
