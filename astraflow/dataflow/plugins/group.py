"""A group: the trajectories of one task and one policy whose advantages are normalised together. The
unit every dataflow plug-in sees, so it sits with their contracts (the dataflow builds groups, the
plug-ins filter, sample and select them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from astraflow.records import Trajectory


@dataclass(slots=True)
class Group:
    group_id: str
    task_id: str
    policy: str
    task_type: str
    expected: int
    """Samples the task asked for (``Task.samples``)."""
    trajectories: list[Trajectory] = field(default_factory=list)
    dropped: int = 0
    """Samples that arrived but were dropped individually (e.g. stale): they count as accounted for."""
    served: int = 0
    """Batches this group went into so far (more than one only under replay)."""

    @property
    def accounted(self) -> int:
        return len(self.trajectories) + self.dropped

    @property
    def complete(self) -> bool:
        return self.accounted >= self.expected

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def min_version(self) -> int:
        return min((t.min_version for t in self.trajectories), default=0)

    def to_state(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "trajectories"}
        d["trajectories"] = [dataclasses.asdict(t) for t in self.trajectories]
        return d

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Group:
        d = dict(d)
        d["trajectories"] = [Trajectory(**t) for t in d["trajectories"]]
        return cls(**d)
