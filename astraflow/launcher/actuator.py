"""The local autoscaling actuator of ``astraflow run``: the dataflow's report drives a pool's node count.

The dataflow publishes an advisory report on ``<run>.metrics`` every ``dataflow.autoscale.interval_s``
(:mod:`astraflow.dataflow.autoscaler`): per pool, the nodes it saw in the window and the count it
suggests. For each pool with an ``autoscale`` section (:class:`~astraflow.recipe.PoolAutoscale`)
the launcher follows it:

* :class:`PoolScaler` decides, with no clock or process of its own (times are passed in). A report
  is evidence only if it saw at least the nodes the launcher runs (a node just started is not in
  it yet) and comes ``cooldown_s`` after the previous change; the change it asks for (target - seen,
  so nodes joined from elsewhere are left to their owners) is applied to the launcher's own nodes,
  within ``[min_nodes, max_nodes]``, once ``confirm_reports`` such reports in a row agree on its
  direction.
* :class:`Actuator` applies the decisions to the run's :class:`ProcessGroup`: it starts
  ``raas-<pool>-<i>`` exactly like the launcher's first nodes, and retires the newest node with
  SIGTERM, on which a node drains (no new task, running episodes finished for up to the pool's
  ``drain_timeout_s``, committed, consumer group left). What a stopped node did not commit, the
  group delivers to the pool's other nodes; SIGKILL comes only ``grace_s`` after the drain time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astraflow.launcher.plan import node_name
from astraflow.records.control import ActuatorEvent, AutoscaleReport, ControlRecord, PoolReport

if TYPE_CHECKING:
    from astraflow.launcher.supervisor import ChildSpec, ProcessGroup, RestartEvent
    from astraflow.recipe import PoolAutoscale, PoolSpec


@dataclass(frozen=True)
class Decision:
    pool: str
    nodes: int
    """Launcher nodes running before the change."""
    target: int
    """Launcher nodes to run."""
    reason: str
    """The report's reason (``trainer_starved``, ``rollout_surplus``)."""


class PoolScaler:
    """The decisions for one pool (see the module docstring)."""

    def __init__(self, pool: str, cfg: PoolAutoscale, started_at: float) -> None:
        self.pool = pool
        self.cfg = cfg
        self.last_change = started_at
        """The run's start counts as a change: its first nodes are still joining."""
        self._direction = 0
        self._streak = 0

    def wanted(self, report: PoolReport, running: int) -> int:
        """The launcher node count the report asks for: its change applied to ``running``, bounded."""
        return min(max(running + report.target_nodes - report.nodes, self.cfg.min_nodes), self.cfg.max_nodes)

    def observe(self, report: PoolReport, running: int, now: float) -> Decision | None:
        """A report arrived while the launcher runs ``running`` nodes of the pool: the change to make
        now, if any."""
        if report.reason == "no_data" or report.nodes < running or now - self.last_change < self.cfg.cooldown_s:
            return None  # no evidence: a window that missed a node, or one before the last change settled
        want = self.wanted(report, running)
        direction = (want > running) - (want < running)
        if direction != self._direction:
            self._direction, self._streak = direction, 0
        if direction == 0:
            return None
        self._streak += 1
        if self._streak < self.cfg.confirm_reports:
            return None
        self.last_change, self._direction, self._streak = now, 0, 0
        return Decision(self.pool, running, want, report.reason)


class Actuator:
    """Starts and retires the RaaS nodes of the autoscaled pools. Driven from the launcher's loop:
    :meth:`observe` for each metrics record, :meth:`check` on every turn (it is supervised like the
    process group, so it restarts nothing itself)."""

    def __init__(self, pools: list[PoolSpec], group: ProcessGroup, spec: Callable[[str, int], ChildSpec], *,
                 grace_s: float, note: Callable[[ActuatorEvent], None], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.group = group
        self.spec = spec
        self.grace_s = grace_s
        self.note = note
        self.pools = {p.name: p for p in pools if p.autoscale is not None}
        self.scalers = {name: PoolScaler(name, p.autoscale, now) for name, p in self.pools.items()}
        self.members = {name: [node_name(name, i) for i in range(p.nodes)] for name, p in self.pools.items()}
        """Per pool, the launcher's nodes in start order (the newest is retired first)."""
        self.leaving: dict[str, str] = {}
        """Retired nodes not exited yet -> their pool."""
        self.since = time.time()
        """Reports older than the actuator (a resumed run reads its metrics log from the start) are history."""

    def observe(self, record: ControlRecord) -> None:
        if self.group.stopping:
            return  # the run is over: the monitor's last reads must not start anything
        if not isinstance(record, AutoscaleReport) or record.time < self.since:
            return
        for pool, report in record.pools.items():
            if pool in self.scalers:
                decision = self.scalers[pool].observe(report, len(self.members[pool]), time.monotonic())
                if decision is not None:
                    self._apply(decision, report)

    def _apply(self, d: Decision, report: PoolReport) -> None:
        self._record(d.pool, "scale", nodes=d.nodes, target=d.target, reason=d.reason, seen=report.nodes,
                     suggested=report.target_nodes, w=report.w)
        members = self.members[d.pool]
        while len(members) < d.target:
            child = self.group.start(self.spec(d.pool, self._free_index(d.pool)))
            members.append(child.name)
            self._record(d.pool, "start", node=child.name, pid=child.proc.pid)
        while len(members) > d.target:
            name = members.pop()
            self.group.retire(name, self.pools[d.pool].drain_timeout_s + self.grace_s)
            self.leaving[name] = d.pool
            self._record(d.pool, "stop", node=name)

    def _free_index(self, pool: str) -> int:
        """The lowest node index of ``pool`` that no running or draining node uses."""
        i = 0
        while node_name(pool, i) in self.group.children or node_name(pool, i) in self.group.retiring:
            i += 1
        return i

    def check(self, now: float | None = None) -> list[RestartEvent]:
        for r in self.group.reap_retired(now):
            self._record(self.leaving.pop(r.name, ""), "stopped", node=r.name, returncode=r.returncode,
                         drain_s=round(r.seconds, 3))
        return []

    def restarts(self) -> dict[str, int]:
        return {}

    def _record(self, pool: str, event: str, **fields: Any) -> None:
        self.note(ActuatorEvent(pool=pool, event=event, time=time.time(), **fields))


def describe(record: ActuatorEvent) -> str | None:
    """The console line of an actuator record (None: not worth a line)."""
    if record.event == "scale":
        return (f"autoscale pool {record.pool}: {record.nodes} -> {record.target} nodes ({record.reason}; the "
                f"dataflow saw {record.seen} and suggested {record.suggested})")
    if record.event == "stopped":
        how = "drained" if record.returncode == 0 else f"ended with status {record.returncode}"
        return f"autoscale: {record.node} {how} after {record.drain_s or 0.0:.1f} s"
    return None
