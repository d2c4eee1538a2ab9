"""A RaaS node's counters and the periodic status record it puts on ``<run>.metrics``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from astraflow.records.control import NodeStatus


@dataclass
class NodeCounters:
    """What a node did since it started; ``record`` turns it into its status record."""

    node_id: str
    pool: str
    episodes: int = 0
    rejected: int = 0
    trajectories: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    """Episode-slot seconds spent running episodes (summed over concurrent slots)."""
    _last_t: float = field(default_factory=time.monotonic)
    _last_tokens: int = 0
    _last_busy: float = 0.0

    def record(self, concurrency: int, versions: dict[str, int], refresh_s: float, in_flight: int,
               workflow_counters: Mapping[str, int] | None = None,
               weight_counters: Mapping[str, int] | None = None,
               handoff_ms: Mapping[str, dict] | None = None, region: Mapping | None = None) -> NodeStatus:
        """The status record; ``workflow_counters`` (tool calls, tool timeouts, environment
        failures, ...) are cumulative since the node started, under ``workflow``; so are
        ``weight_counters`` (``weights.refused.<reason>``, ``weights.unreachable``), under ``counters``.
        ``handoff_ms``: send -> poll latency per topic since the last record (astraflow.log.handoff).
        ``region``: a node reading a regional replica, its reader's figures
        (:meth:`astraflow.objstore.regional.ReplicaStats.record`)."""
        now = time.monotonic()
        dt = max(now - self._last_t, 1e-9)
        rec = NodeStatus(
            id=self.node_id, time=time.time(), node_id=self.node_id, pool=self.pool, episodes=self.episodes,
            rejected=self.rejected, trajectories=self.trajectories, tokens=self.tokens,
            tokens_per_s=(self.tokens - self._last_tokens) / dt, versions=dict(versions),
            busy_fraction=min(1.0, (self.busy_s - self._last_busy) / (dt * concurrency)), refresh_s=refresh_s,
            in_flight=in_flight, workflow=dict(workflow_counters or {}), counters=dict(weight_counters or {}),
            handoff_ms=dict(handoff_ms or {}), region=None if region is None else dict(region))
        self._last_t, self._last_tokens, self._last_busy = now, self.tokens, self.busy_s
        return rec
