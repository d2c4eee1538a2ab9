"""The periodic status records on ``<run>.metrics``: a node's, the dataflow's counters and its
autoscaling report. The live view, ``metrics.jsonl`` and the archive read them; the autoscaling report
also steers the launcher's actuator, and a node's status tells the dataflow which pools have nodes."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.records.control.base import ControlRecord, absent


class NodeStatus(ControlRecord):
    """A RaaS node's counters since it started, every few seconds (key: the node id)."""

    SCHEMA_NAME: ClassVar[str] = "node-status"
    SCHEMA_VERSION: ClassVar[int] = 1
    component: Literal["raas"] = "raas"
    """The writer's kind of component."""
    id: str
    """The writer's component id: the node id."""
    time: float
    """Unix time the record was written."""
    node_id: str
    """The node."""
    pool: str
    """The pool it serves."""
    episodes: int = Field(ge=0)
    """Episodes run."""
    rejected: int = Field(ge=0)
    """Tasks refused (not for this node's policies, or malformed)."""
    trajectories: int = Field(ge=0)
    """Trajectories sent."""
    tokens: int = Field(ge=0)
    """Tokens generated."""
    tokens_per_s: float
    """Generation rate since the previous record."""
    versions: dict[str, int]
    """Policy -> the weight version the node serves."""
    busy_fraction: float
    """Share of episode-slot time spent running episodes since the previous record."""
    refresh_s: float
    """Seconds of the last weight refresh."""
    in_flight: int = Field(ge=0)
    """Episodes running now."""
    workflow: dict[str, int]
    """The workflows' cumulative counters (tool calls, tool timeouts, environment failures, ...)."""
    counters: dict[str, int]
    """The weight plane's cumulative counters (``weights.refused.<reason>``, ``weights.unreachable``)."""
    handoff_ms: dict[str, dict[str, Any]]
    """Send -> poll latency per topic since the previous record (:mod:`astraflow.log.handoff`)."""
    region: dict[str, Any] | None = Field(default=None, exclude_if=absent)
    """A node reading a regional replica: its reader's figures; absent otherwise."""


class DataflowCounters(ControlRecord):
    """The dataflow's counters, every ``metrics_every_s`` (key: ``dataflow``)."""

    SCHEMA_NAME: ClassVar[str] = "dataflow-counters"
    SCHEMA_VERSION: ClassVar[int] = 1
    component: Literal["dataflow"] = "dataflow"
    """The writer's kind of component."""
    id: str = "dataflow"
    """The writer's component id."""
    kind: Literal["dataflow"] = "dataflow"
    """Tells it from the dataflow's autoscaling report."""
    time: float
    """Unix time the record was written."""
    versions: dict[str, int]
    """Policy -> the newest weight version the dataflow knows."""
    counters: dict[str, int]
    """Flat counters: ``tasks.emitted``, ``trajectories.dropped.stale``, ``batches.<policy>.batches``, ..."""
    handoff_ms: dict[str, dict[str, Any]]
    """Send -> poll latency per topic since the previous record."""


ScalingReason = Literal["trainer_starved", "rollout_surplus", "in_band", "no_data"]
"""Why a pool's suggested count is what it is (:func:`astraflow.dataflow.autoscaler.target_nodes`)."""


class PoolReport(BaseModel):
    """One pool's entry in the autoscaling report."""

    model_config = ConfigDict(extra="ignore")
    nodes: int = Field(ge=0)
    """Nodes of the pool seen in the window (trajectories or metrics records)."""
    target_nodes: int = Field(ge=0)
    """Suggested node count."""
    w: float = 0.0
    """Trainer wait / step time over the window."""
    reason: ScalingReason
    """Why that count."""


class AutoscaleReport(ControlRecord):
    """How many nodes each pool should have, every ``autoscale.interval_s`` (key: ``dataflow``);
    :mod:`astraflow.dataflow.autoscaler` writes it, the launcher's actuator acts on it."""

    SCHEMA_NAME: ClassVar[str] = "autoscale-report"
    SCHEMA_VERSION: ClassVar[int] = 1
    component: Literal["dataflow"] = "dataflow"
    """The writer's kind of component."""
    id: str = "dataflow"
    """The writer's component id."""
    kind: Literal["autoscale"] = "autoscale"
    """Tells it from the dataflow's counters."""
    time: float
    """Unix time of the window's end."""
    pools: dict[str, PoolReport]
    """Pool -> its entry."""


STATUS_RECORDS: tuple[type[ControlRecord], ...] = (NodeStatus, DataflowCounters, AutoscaleReport)
