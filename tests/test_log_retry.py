"""The retry loop of topic creation, driven by a fake admin client (the retry logic only: the
real broker paths are in test_log_broker.py)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from kafka.errors import (
    IncompatibleBrokerVersion,
    InvalidConfigurationError,
    KafkaTimeoutError,
    LeaderNotAvailableError,
    NotControllerError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
)

from astraflow.config import ClusterConfig, KafkaSettings
from astraflow.log import BrokerUnavailableError, LogError, ensure_topics
from astraflow.log.retry import retry_transient

CFG = ClusterConfig(run="r", kafka=KafkaSettings(bootstrap="broker-1:9092"))


class FakeAdmin:
    """Answers ``create_topics`` from a script: an exception to raise, or ``{topic: error code}``."""

    def __init__(self, script: list) -> None:
        self.script = script
        self.requests: list[list[str]] = []
        self.closed = 0

    def factory(self, cfg: ClusterConfig, timeout_s: float) -> FakeAdmin:
        step = self.script[0]
        if isinstance(step, BrokerUnavailableError):
            self.script.pop(0)
            raise step
        return self

    def create_topics(self, spec: dict, timeout_ms: int, raise_errors: bool) -> dict:
        assert raise_errors is False and timeout_ms > 0
        self.requests.append(sorted(spec))
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return {"topics": [{"name": n, "error_code": step.get(n, 0), "error_message": None} for n in spec]}

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def fast_backoff(monkeypatch):
    """No real sleeping between attempts; records the waits."""
    waits: list[float] = []
    monkeypatch.setattr("astraflow.log.retry.time", SimpleNamespace(sleep=waits.append, monotonic=time.monotonic))
    return waits


def test_transient_errors_are_retried_one_log_line_each(fast_backoff, caplog):
    admin = FakeAdmin([
        BrokerUnavailableError("no broker yet"),
        KafkaTimeoutError("CreateTopics timed out"),
        {"r.a": NotControllerError.errno, "r.b": 0},
        {"r.a": LeaderNotAvailableError.errno},
        {"r.a": 0},
    ])
    with caplog.at_level(logging.WARNING, logger="astraflow.log.retry"):
        created = ensure_topics(CFG, {"r.a": 1, "r.b": 2}, admin_factory=admin.factory)
    assert sorted(created) == ["r.a", "r.b"]
    # r.b, created by the third request, is not asked for again
    assert admin.requests == [["r.a", "r.b"], ["r.a", "r.b"], ["r.a"], ["r.a"]]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all("broker-1:9092" in line for line in lines)
    assert "NotControllerError" in lines[2] and "r.a" in lines[2]
    assert fast_backoff == [0.5, 1.0, 2.0, 4.0]  # exponential, capped at 5 s
    assert admin.closed == 4


def test_a_topic_created_by_a_timed_out_request_is_found_existing(fast_backoff):
    admin = FakeAdmin([RequestTimedOutError("slow"), {"r.a": TopicAlreadyExistsError.errno}])
    assert ensure_topics(CFG, {"r.a": 1}, admin_factory=admin.factory) == []
    assert len(admin.requests) == 2


@pytest.mark.parametrize("answer", [{"r.a": InvalidConfigurationError.errno}, IncompatibleBrokerVersion("old")],
                         ids=["invalid-config-code", "non-retriable-exception"])
def test_non_retriable_errors_fail_at_once_naming_broker_and_topic(fast_backoff, answer):
    admin = FakeAdmin([answer, {"r.a": 0}])
    with pytest.raises(LogError, match=r"broker-1:9092.*r\.a"):
        ensure_topics(CFG, {"r.a": 1}, admin_factory=admin.factory)
    assert len(admin.requests) == 1 and fast_backoff == []


def test_gives_up_at_the_deadline_naming_what_and_where():
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    def attempt(timeout_s: float) -> None:
        assert 1.0 <= timeout_s <= 10.0
        now[0] += timeout_s  # every attempt times out
        raise KafkaTimeoutError("no answer")

    with pytest.raises(LogError, match=r"creating topics on b:1: still failing after \d+ attempts in 30 s"):
        retry_transient(attempt, what="creating topics", endpoint="b:1", deadline_s=30, sleep=sleep,
                        clock=lambda: now[0])
    assert 30 <= now[0] <= 41  # never sleeps past the deadline; the last attempt may take its timeout


def test_no_broker_until_the_deadline_stays_a_broker_unavailable_error():
    def attempt(timeout_s: float) -> None:
        raise BrokerUnavailableError("admin: no Kafka broker answered at b:1")

    with pytest.raises(BrokerUnavailableError, match="b:1"):
        retry_transient(attempt, what="creating topics", endpoint="b:1", deadline_s=0.2, first_backoff_s=0.05)
