"""Advisory autoscaling: how many rollout nodes each pool should have.

w = trainer wait / trainer step time. Above the dead band the trainer starves: suggest
``ceil(nodes / (1 - w))``. Below it rollouts outpace training: suggest
``min(nodes, ceil(nodes * consumed / entered * 1.1))``. Inside the band: keep ``nodes``. The report
is a typed record on the metrics topic (:class:`~astraflow.records.control.AutoscaleReport`, one
:class:`~astraflow.records.control.PoolReport` per pool); the dataflow starts or stops nothing. ``astraflow run`` can act on it for pools that opt in
(:mod:`astraflow.launcher.actuator`).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from astraflow.records.control import AutoscaleReport, PoolReport
from astraflow.records.control.status import ScalingReason


class AutoscaleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    band_low: float = Field(default=0.05, ge=0.0)
    """Below this trainer wait fraction the pool is over-provisioned."""
    band_high: float = Field(default=0.10, ge=0.0)
    """Above this trainer wait fraction the pool is under-provisioned."""
    headroom: float = Field(default=1.1, ge=1.0)
    """Multiplier on the consumed/entered ratio when shrinking."""
    max_wait_fraction: float = Field(default=0.9, gt=0.0, lt=1.0)
    """w is clipped to this so that a fully starved trainer asks for a finite number of nodes."""
    min_nodes: int = Field(default=1, ge=0)
    """Lower bound of every pool's suggested count."""
    max_nodes: int | None = Field(default=None, ge=1)
    """Upper bound of every pool's suggested count (``None``: none). The launcher's actuator also
    applies each pool's own bounds (``pools[].autoscale``)."""
    interval_s: float = Field(default=30.0, gt=0)
    """How often the dataflow publishes the report; its window (nodes seen, trainer wait and step
    time, trajectories) is the time since the previous one. Keep it above the nodes' metrics
    interval (5 s), so that every live node is seen in every window."""


def _ceil(x: float) -> int:
    # 4 / (1 - 0.9) is 40.000000000000004 in binary floating point: not a reason for a 41st node.
    return math.ceil(round(x, 9))


def target_nodes(
    cfg: AutoscaleConfig, nodes: int, wait_s: float, step_s: float, consumed: int, entered: int
) -> tuple[int, float, ScalingReason]:
    """(target node count, w, reason) for one pool."""
    if nodes <= 0 or step_s <= 0:
        return max(nodes, cfg.min_nodes), 0.0, "no_data"
    w = wait_s / step_s
    if w > cfg.band_high:
        target, reason = _ceil(nodes / (1 - min(w, cfg.max_wait_fraction))), "trainer_starved"
    elif w < cfg.band_low and entered > 0:
        target, reason = min(nodes, _ceil(nodes * consumed / entered * cfg.headroom)), "rollout_surplus"
    else:
        target, reason = nodes, "in_band"
    target = max(target, cfg.min_nodes)
    if cfg.max_nodes is not None:
        target = min(target, cfg.max_nodes)
    return target, w, reason


def autoscale_report(cfg: AutoscaleConfig, pools: dict[str, dict[str, float]], now: float) -> AutoscaleReport:
    """The report. ``pools[name]`` has ``nodes``, ``wait_s``, ``step_s`` (trainer totals over the window,
    summed over the policies the pool serves), ``consumed`` (trajectories that went into batches) and
    ``entered`` (trajectories received)."""
    entries = {}
    for name, p in pools.items():
        target, w, reason = target_nodes(
            cfg, int(p["nodes"]), p["wait_s"], p["step_s"], int(p["consumed"]), int(p["entered"])
        )
        entries[name] = PoolReport(nodes=int(p["nodes"]), target_nodes=target, w=w, reason=reason)
    return AutoscaleReport(time=now, pools=entries)
