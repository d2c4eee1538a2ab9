"""Hand-off latency: how long a record waited between its producer's send and its consumer's poll.

Each :class:`~astraflow.log.consumer.LogConsumer` keeps one :class:`HandoffLatency`; components put
its :meth:`~HandoffLatency.drain` in their metrics records (field ``handoff_ms``), so the pipeline's
hand-offs (task -> node, trajectory -> dataflow, batch -> trainer, announcement -> node) are measured
from the log without instrumenting the components further (``benchmarks/pipeline_overhead.py``).

The producer's clock stamps the record (Kafka ``CreateTime``) and the consumer's clock reads it: the
figures are exact on one machine, and carry the clock offset between machines otherwise. A record that
waited because its consumer was busy counts its queueing too: that is the hand-off a component sees.
"""

from __future__ import annotations

import time
from collections import defaultdict


class HandoffLatency:
    """Milliseconds from send to poll, per topic, since the last :meth:`drain`."""

    def __init__(self, max_samples: int = 4096, clock=time.time) -> None:
        self.max_samples = max_samples
        self._clock = clock
        self._samples: dict[str, list[float]] = defaultdict(list)

    def observe(self, topic: str, timestamp_ms: int | None) -> None:
        """A record of ``topic`` stamped ``timestamp_ms`` was just polled."""
        if timestamp_ms is None or timestamp_ms <= 0:
            return
        samples = self._samples[topic]
        if len(samples) < self.max_samples:  # bounded: a backlog read at start-up must not grow memory
            samples.append(max(0.0, self._clock() * 1000.0 - timestamp_ms))

    def drain(self, keep_samples: int = 256) -> dict[str, dict]:
        """``{topic: {"n", "p50", "p99", "max", "samples"}}`` since the last call, then forget them.
        ``samples``: up to ``keep_samples`` of the values, evenly spaced, so that a reader can merge
        the records of a run into its own quantiles."""
        taken, self._samples = self._samples, defaultdict(list)  # one swap: safe beside observe()'s thread
        out = {}
        for topic, samples in taken.items():
            if samples:
                stride = max(1, -(-len(samples) // keep_samples))
                out[topic] = {**summarise(samples), "samples": [round(x, 1) for x in samples[::stride]]}
        return out


def summarise(samples: list[float]) -> dict[str, float]:
    """Count, p50, p99 and max of ``samples`` (milliseconds, rounded to 0.1)."""
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 1)

    return {"n": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 1)}
