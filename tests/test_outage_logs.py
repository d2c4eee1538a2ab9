"""A lost broker or bucket: one log line per backoff step naming the endpoint, and the component
carries on when it returns. Unit tests of the report and the kafka-python log filter, then a RaaS node
on an embedded stack of its own whose broker and S3 server are killed and restarted."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest

from astraflow.log.client_logs import KafkaClientLogs
from astraflow.outage import OutageReport


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_outage_report_logs_on_a_backoff_schedule_and_once_on_recovery(caplog):
    clock = _Clock()
    report = OutageReport("S3 endpoint", "http://s3:1", logging.getLogger("t.outage"), clock=clock)
    report.ok()  # nothing to close
    waits = []
    with caplog.at_level(logging.WARNING, logger="t.outage"):
        for _ in range(200):  # 20 s of failures every 0.1 s
            waits.append(report.failed(ConnectionRefusedError("refused")))
            clock.now += 0.1
        report.ok()
        report.ok()
    lines = [r.getMessage() for r in caplog.records]
    # at 0 s, then after 1, 3, 7, 15 s (backoff 1, 2, 4, 8, 16), then "answers again" once
    assert len(lines) == 6, lines
    assert all("http://s3:1" in line for line in lines)
    assert "unreachable: ConnectionRefusedError: refused" in lines[0]
    assert "still unreachable after 15 s" in lines[4] and "answers again after 20 s" in lines[5]
    assert waits[0] == 1.0 and max(waits) == 16.0 and not report.down


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, (), None)


def test_kafka_client_logs_become_outage_lines(caplog):
    flt = KafkaClientLogs("127.0.0.1:9092", repeat_s=30)
    with caplog.at_level(logging.WARNING, logger="astraflow.log.broker"):
        passed = [flt.filter(_record("kafka.net.connection", logging.ERROR, f"<conn {i}>: Connection lost: "
                                     "KafkaConnectionError: 111 ECONNREFUSED")) for i in range(90)]
        passed.append(flt.filter(_record("kafka.net.connection", logging.INFO, "<conn>: Connected")))
    assert not any(passed)  # none of kafka-python's own lines is printed
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "Kafka broker 127.0.0.1:9092 unreachable" in lines[0] and "answers again" in lines[1]
    # other kafka-python warnings: once per template per repeat_s; our own records pass untouched
    other = [flt.filter(_record("kafka.coordinator", logging.WARNING, "Heartbeat failed: rebalancing"))
             for _ in range(5)]
    assert other == [True, False, False, False, False]
    # a socket error logged with its traceback counts as the outage, whatever the message says
    reset = _record("kafka.net.transport", logging.ERROR, "<KafkaTCPTransport [none]>: closing socket")
    reset.exc_info = (ConnectionResetError, ConnectionResetError(104, "Connection reset by peer"), None)
    assert not flt.filter(reset)
    assert flt.filter(_record("astraflow.raas.node", logging.ERROR, "socket disconnected"))
    assert flt.filter(_record("kafka.x", logging.CRITICAL, "socket disconnected"))


@pytest.mark.integration
@pytest.mark.slow
def test_node_waits_out_a_lost_broker_and_bucket_quietly(tmp_path: Path):
    from raas_support import (
        TopicReader,
        publish_v0,
        recipe_dict,
        send_tasks,
        start_component,
        stop,
        write_files,
    )

    from astraflow.config import ClusterConfig
    from astraflow.embedded import EmbeddedStack

    stack, _ = EmbeddedStack.start_private(tmp_path / "state", storage="s3")  # the log survives a broker restart
    node = None
    try:
        cfg = ClusterConfig(run=f"outage-{uuid.uuid4().hex[:6]}", state_dir=tmp_path / "state").resolve()
        publish_v0(cfg)
        cfg_path, recipe_path = write_files(tmp_path, cfg, recipe_dict(cfg.run))
        log_path = tmp_path / "node.log"
        node = start_component(["raas", "--recipe", str(recipe_path), "--node-id", "n1"], cfg_path, log_path)

        def lines() -> list[str]:
            return log_path.read_text().splitlines()

        def served(prefix: str) -> None:
            reader = TopicReader(cfg, f"{cfg.run}.trajectories")
            try:
                reader.until(lambda items: any(t.task_id.startswith(prefix) for t in items), 120,
                             f"trajectories of {prefix}", alive=lambda: node.poll() is None or pytest.fail(
                                 "\n".join(lines()[-40:])))
            finally:
                reader.close()

        send_tasks(cfg, 2, "before")
        served("before-")
        n0 = len(lines())
        stack.kafka.kill()
        time.sleep(5)  # deliberate: a 5 s broker outage, whose log lines are counted below
        broker_lines = lines()[n0:]
        n1 = len(lines())
        stack.s3.kill()
        time.sleep(8)  # deliberate: 8 s with S3 down too, whose log lines are counted below
        both_lines = lines()[n1:]
        assert node.poll() is None, "\n".join(lines()[-40:])
        stack.start_service(stack.s3.name)
        stack.start_service(stack.kafka.name)
        send_tasks(cfg, 2, "after")
        served("after-")
        print(f"broker down 5 s: {len(broker_lines)} lines; S3 down too, 8 s: {len(both_lines)} lines")
        assert len(broker_lines) <= 6, broker_lines
        assert any(f"Kafka broker {cfg.kafka.bootstrap} unreachable" in line for line in broker_lines)
        assert len(both_lines) <= 8 and any(f"S3 endpoint {cfg.s3.endpoint} unreachable" in line
                                            for line in both_lines), both_lines
        assert "Traceback" not in log_path.read_text()
        assert node.poll() is None
    finally:
        if node is not None:
            stop(node)
        stack.down()
