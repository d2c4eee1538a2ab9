"""UntilAcked sends a refused record again, forgets acknowledged ones, and settle() waits for them all.

The first two tests' producer hands out kafka-python's own futures, resolved by the test, so that a
refusal can be chosen; the last one has the real stack refuse a record while the log's bucket restarts.
The whole-run check is benchmarks/chaos.py (its ``steps_without_record`` after bucket kills)."""

from __future__ import annotations

import threading
import time

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


def test_a_record_refused_while_the_logs_bucket_restarts_reaches_the_log_once(tmp_path):
    """Real stack (Tansu keeps its log in the embedded SeaweedFS): with the bucket down, Tansu refuses
    produce requests. A plain send is lost; the record sent through UntilAcked is in the log once."""
    import uuid

    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack
    from astraflow.log import LogConsumer, LogProducer, Topics, ensure_topics

    stack, _ = EmbeddedStack.start_private(tmp_path / "state", storage="s3")
    try:
        cfg = ClusterConfig(run=f"acked-{uuid.uuid4().hex[:6]}", state_dir=tmp_path / "state").resolve()
        topic = Topics(cfg.run).metrics
        ensure_topics(cfg, {topic: 1})
        with LogProducer(cfg, "trainer-test") as producer:
            producer.send_json(topic, "trainer", {"step": 0}).result(30)
            records = UntilAcked(producer)
            stack.s3.kill()
            plain = producer.send_json(topic, "trainer", {"step": "plain"})
            records.send_json(topic, "trainer", {"step": 1})
            refusal = plain.exception(60)
            time.sleep(1.0)  # deliberate: the bucket stays down a while, so the outage refuses more than one send
            records.resend_refused()  # refused meanwhile: sent again, and refused again while the bucket is down
            stack.start_service(stack.s3.name)
            assert records.settle(60) is True
        assert refusal is not None, "the outage refused nothing: this test does not exercise a refusal"
        assert records.resent >= 1
        with LogConsumer(cfg, [topic], f"reader-{cfg.run}") as consumer:
            seen: list = []
            for _ in range(60):
                seen += [m.obj["step"] for m in consumer.poll(0.5)]
                if 1 in seen:
                    time.sleep(1.0)  # a duplicate would arrive with it
                    seen += [m.obj["step"] for m in consumer.poll(0.5)]
                    break
        assert seen.count(1) == 1 and "plain" not in seen, seen
    finally:
        stack.down()
