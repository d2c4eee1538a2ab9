"""Hand-off latency: send -> poll milliseconds per topic, drained into metrics records."""

from __future__ import annotations

from astraflow.log.handoff import HandoffLatency, summarise


def test_latency_is_poll_time_minus_record_timestamp_and_drain_forgets():
    now = [100.0]
    latency = HandoffLatency(clock=lambda: now[0])
    for sent_ms in (99_990, 99_980, 99_900):  # 10, 20 and 100 ms before the poll
        latency.observe("run.tasks.default", sent_ms)
    latency.observe("run.tasks.default", None)  # no timestamp: not a sample
    latency.observe("run.metrics", 100_001)  # a clock a little ahead: never negative
    out = latency.drain()
    assert out["run.tasks.default"] == {"n": 3, "p50": 20.0, "p99": 100.0, "max": 100.0,
                                        "samples": [10.0, 20.0, 100.0]}
    assert out["run.metrics"]["p50"] == 0.0
    assert latency.drain() == {}


def test_samples_are_bounded():
    latency = HandoffLatency(max_samples=5, clock=lambda: 1.0)
    for _ in range(50):
        latency.observe("t", 500)
    assert latency.drain()["t"]["n"] == 5
    many = HandoffLatency(clock=lambda: 1.0)
    for i in range(1000):
        many.observe("t", i + 1)
    drained = many.drain(keep_samples=10)["t"]
    assert drained["n"] == 1000 and len(drained["samples"]) == 10  # evenly spaced, for merging


def test_summarise_quantiles():
    assert summarise(list(range(101))) == {"n": 101, "p50": 50, "p99": 99, "max": 100}
