"""The scalars a sink writes, from the typed records of ``<run>.metrics``: (tag, value, step) triples.

Trainer steps give ``<policy>/<figure>`` at their step. A node's status gives
``pool/<pool>/tokens_per_s`` (the pool's nodes summed, each node's latest rate) at the last trainer step
written before it (by the records' times), so that every figure shares the step axis. Records of
different writers reach the consumer in no set order (other partitions), so a status waits until a
trainer step at or after its time has come, or the end.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from astraflow.records.control import ControlRecord, NodeStatus, TrainerStep

STEP_FIGURES = ("reward_mean", "truncated_frac", "response_len_mean", "response_len_max", "loss", "grad_norm",
                "clip_frac", "behav_kl", "entropy", "staleness_mean", "staleness_max", "wait_s", "step_s",
                "tokens", "publish_s")
"""Fields of a :class:`TrainerStep` written as ``<policy>/<field>`` when present."""


@dataclass
class ScalarFolder:
    """Folds records into scalars."""

    step_times: list[float] = field(default_factory=list)
    """Times of the trainer steps seen, sorted, with ``steps`` alongside."""
    steps: list[int] = field(default_factory=list)
    pending: list[NodeStatus] = field(default_factory=list)
    """Node statuses not yet written: no trainer step at or after their time seen yet."""
    node_rates: dict[str, list[tuple[float, str, float]]] = field(default_factory=dict)
    """node id -> its statuses written so far as (time, pool, tokens/s), sorted by time."""

    def scalars(self, record: ControlRecord) -> list[tuple[str, float, int]]:
        match record:
            case TrainerStep():
                i = bisect.bisect(self.step_times, record.time)
                self.step_times.insert(i, record.time)
                self.steps.insert(i, record.step)
                out = [(f"{record.policy}/{name}", float(value), record.step) for name in STEP_FIGURES
                       if (value := getattr(record, name)) is not None]
                out.append((f"{record.policy}/busy_fraction", record.busy_fraction, record.step))
                return out + self._release(record.time)
            case NodeStatus():
                self.pending.append(record)
                return self._release(self.step_times[-1] if self.step_times else float("-inf"))
        return []

    def flush(self) -> list[tuple[str, float, int]]:
        """The statuses still waiting, at the latest step (the end of the records)."""
        return self._release(float("inf"))

    def _release(self, until: float) -> list[tuple[str, float, int]]:
        ready = sorted((s for s in self.pending if s.time <= until), key=lambda s: s.time)
        self.pending = [s for s in self.pending if s.time > until]
        out = []
        for status in ready:
            bisect.insort(self.node_rates.setdefault(status.node_id, []),
                          (status.time, status.pool, status.tokens_per_s))
            total = self._pool_rate(status.pool, status.time)
            i = bisect.bisect(self.step_times, status.time)
            step = self.steps[i - 1] if i else 0
            out.append((f"pool/{status.pool}/tokens_per_s", total, step))
        return out

    def _pool_rate(self, pool: str, at: float) -> float:
        """The pool's nodes' latest rates at time ``at``, summed (whatever order their statuses came in)."""
        total = 0.0
        for history in self.node_rates.values():
            i = bisect.bisect(history, (at, "\uffff", float("inf")))
            if i and history[i - 1][1] == pool:
                total += history[i - 1][2]
        return total
