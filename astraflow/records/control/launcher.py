"""The launcher's own records (``astraflow run``): supervision and autoscaling events. They are never on
the log; the launcher writes them to ``metrics.jsonl`` beside the topic's records and folds them into
its live view."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from astraflow.records.control.base import ControlRecord, absent


class SupervisorEvent(ControlRecord):
    """A component died: it was started again (``restart``) or the run gave up on it (``failed``)."""

    SCHEMA_NAME: ClassVar[str] = "supervisor-event"
    SCHEMA_VERSION: ClassVar[int] = 1
    kind: Literal["supervisor"] = "supervisor"
    """Tells the launcher's records apart in ``metrics.jsonl``."""
    component: str
    """The component's name in the launcher (``trainer-<policy>``, ``raas-<pool>-<i>``, ...)."""
    event: Literal["restart", "failed"]
    """What the launcher did."""
    returncode: int | None
    """How the process ended (None: unknown)."""
    restarts: int = Field(ge=0)
    """Restarts of this component so far in the run."""
    time: float
    """Unix time of the event."""
    backoff_s: float | None = Field(default=None, exclude_if=absent)
    """A restart: seconds waited before it."""
    pid: int | None = Field(default=None, exclude_if=absent)
    """A restart: the new process's id."""


class ActuatorEvent(ControlRecord):
    """The actuator acted on an autoscaling report: decided a count (``scale``), started a node
    (``start``), asked one to drain (``stop``), saw a drained one exit (``stopped``)."""

    SCHEMA_NAME: ClassVar[str] = "actuator-event"
    SCHEMA_VERSION: ClassVar[int] = 1
    kind: Literal["actuator"] = "actuator"
    """Tells the launcher's records apart in ``metrics.jsonl``."""
    component: Literal["actuator"] = "actuator"
    """The writer."""
    pool: str
    """The pool scaled."""
    event: Literal["scale", "start", "stop", "stopped"]
    """What the actuator did."""
    time: float
    """Unix time of the event."""
    node: str | None = Field(default=None, exclude_if=absent)
    """``start``, ``stop``, ``stopped``: the node."""
    nodes: int | None = Field(default=None, exclude_if=absent)
    """``scale``: the pool's nodes before."""
    target: int | None = Field(default=None, exclude_if=absent)
    """``scale``: the pool's nodes after."""
    reason: str | None = Field(default=None, exclude_if=absent)
    """``scale``: the report's reason."""
    seen: int | None = Field(default=None, exclude_if=absent)
    """``scale``: nodes the dataflow saw in its window."""
    suggested: int | None = Field(default=None, exclude_if=absent)
    """``scale``: the dataflow's suggested count."""
    w: float | None = Field(default=None, exclude_if=absent)
    """``scale``: trainer wait / step time of the report."""
    pid: int | None = Field(default=None, exclude_if=absent)
    """``start``: the node's process id."""
    returncode: int | None = Field(default=None, exclude_if=absent)
    """``stopped``: how the node's process ended."""
    drain_s: float | None = Field(default=None, exclude_if=absent)
    """``stopped``: seconds from the stop to the exit."""


LAUNCHER_RECORDS: tuple[type[ControlRecord], ...] = (SupervisorEvent, ActuatorEvent)
