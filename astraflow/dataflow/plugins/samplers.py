"""Batch-serving plug-ins: which buffered groups make up the next batch of one policy."""

from __future__ import annotations

import heapq
import random
from collections import deque
from typing import Any

from pydantic import Field

from astraflow.dataflow.plugins.base import BatchSampler, PluginOptions, register_plugin
from astraflow.dataflow.plugins.group import Group
from astraflow.dataflow.plugins.rng_state import rng_from_state, rng_to_state


@register_plugin("fifo")
class Fifo(BatchSampler):
    """Groups in arrival order."""

    def __init__(self, options: PluginOptions | None = None) -> None:
        super().__init__(options)
        self.fresh: deque[Group] = deque()

    def add(self, group: Group) -> None:
        self.fresh.append(group)

    def sample(self, n_groups: int) -> list[Group] | None:
        if len(self.fresh) < n_groups:
            return None
        return [self.fresh.popleft() for _ in range(n_groups)]

    def buffered(self) -> int:
        return len(self.fresh)

    def drain(self) -> list[Group]:
        out = list(self.fresh)
        self.fresh.clear()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"fresh": [g.to_state() for g in self.fresh]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fresh = deque(Group.from_state(g) for g in state["fresh"])


@register_plugin("oldest_first")
class OldestFirst(BatchSampler):
    """Earliest deadline first: the groups whose oldest token version is lowest go first (arrival order
    among equals). A long-tail episode that finishes behind newer ones is then not overtaken by them;
    with the dataflow's emission pacing, a group of oldest version v is trained by version
    v + max_staleness at the latest, whatever the order episodes finish in, so fewer are dropped as
    stale (``benchmarks/async_vs_sync.py --sampler oldest_first``)."""

    def __init__(self, options: PluginOptions | None = None) -> None:
        super().__init__(options)
        self.heap: list[tuple[int, int, Group]] = []
        self.seq = 0

    def add(self, group: Group) -> None:
        heapq.heappush(self.heap, (group.min_version, self.seq, group))
        self.seq += 1

    def sample(self, n_groups: int) -> list[Group] | None:
        if len(self.heap) < n_groups:
            return None
        return [heapq.heappop(self.heap)[2] for _ in range(n_groups)]

    def ahead_of(self, version: int) -> int:
        return sum(1 for v, _, _ in self.heap if v <= version)

    def buffered(self) -> int:
        return len(self.heap)

    def drain(self) -> list[Group]:
        out = [g for _, _, g in sorted(self.heap, key=lambda e: e[:2])]
        self.heap.clear()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "groups": [[seq, g.to_state()] for _, seq, g in sorted(self.heap, key=lambda e: e[:2])]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seq = state["seq"]
        self.heap = []
        for seq, g in state["groups"]:
            group = Group.from_state(g)
            heapq.heappush(self.heap, (group.min_version, seq, group))


class ReplayOptions(PluginOptions):
    replay_ratio: float = Field(default=0.25, ge=0.0, lt=1.0)
    """Fraction of each batch's groups drawn from the replay buffer (once it holds enough)."""
    capacity: int = Field(default=256, ge=1)
    """Trained groups kept for replay (oldest evicted first)."""
    seed: int = 0


@register_plugin("replay")
class Replay(Fifo):
    """FIFO fresh groups plus ``round(n * replay_ratio)`` groups drawn uniformly from the groups
    already trained on. Replayed groups keep their behaviour log-probs and token versions, so the
    trainer's importance weights correct for their age."""

    Options = ReplayOptions

    def __init__(self, options: ReplayOptions | None = None) -> None:
        super().__init__(options)
        self.rng = random.Random(self.options.seed)
        self.replay: deque[Group] = deque(maxlen=self.options.capacity)

    def sample(self, n_groups: int) -> list[Group] | None:
        n_replay = min(round(n_groups * self.options.replay_ratio), len(self.replay))
        n_fresh = n_groups - n_replay
        if len(self.fresh) < n_fresh:
            return None
        replayed = self.rng.sample(list(self.replay), n_replay)
        fresh = [self.fresh.popleft() for _ in range(n_fresh)]
        self.replay.extend(fresh)
        return fresh + replayed

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "replay": [g.to_state() for g in self.replay],
            "rng": rng_to_state(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.replay = deque((Group.from_state(g) for g in state["replay"]), maxlen=self.options.capacity)
        self.rng = rng_from_state(state["rng"])


class MixingOptions(PluginOptions):
    weights: dict[str, float] = Field(default_factory=dict)
    """Task type -> share of each batch (normalised). Types not listed get no quota."""
    fill_from_others: bool = True
    """When a type is short, fill its share from the other types instead of waiting (avoids a
    stall when a type runs out)."""


@register_plugin("mixing")
class Mixing(BatchSampler):
    """Batches mixed by task type in fixed proportions (largest-remainder quotas)."""

    Options = MixingOptions

    def __init__(self, options: MixingOptions | None = None) -> None:
        super().__init__(options)
        self.by_type: dict[str, deque[Group]] = {}

    def add(self, group: Group) -> None:
        self.by_type.setdefault(group.task_type, deque()).append(group)

    def quotas(self, n: int) -> dict[str, int]:
        w = {k: v for k, v in self.options.weights.items() if v > 0}
        total = sum(w.values())
        if not total:
            return {}
        exact = {k: n * v / total for k, v in w.items()}
        q = {k: int(x) for k, x in exact.items()}
        for k in sorted(exact, key=lambda k: exact[k] - q[k], reverse=True)[: n - sum(q.values())]:
            q[k] += 1
        return q

    def sample(self, n_groups: int) -> list[Group] | None:
        if self.buffered() < n_groups:
            return None
        q = self.quotas(n_groups)
        short = any(len(self.by_type.get(k, ())) < v for k, v in q.items())
        if short and not self.options.fill_from_others:
            return None
        out: list[Group] = []
        for k, v in q.items():
            dq = self.by_type.get(k, deque())
            out += [dq.popleft() for _ in range(min(v, len(dq)))]
        # Fill the rest from the fullest type, so no type's backlog grows without bound.
        while len(out) < n_groups:
            k = max((k for k, dq in self.by_type.items() if dq), key=lambda k: len(self.by_type[k]))
            out.append(self.by_type[k].popleft())
        return out

    def buffered(self) -> int:
        return sum(len(d) for d in self.by_type.values())

    def drain(self) -> list[Group]:
        out = [g for d in self.by_type.values() for g in d]
        self.by_type.clear()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"by_type": {k: [g.to_state() for g in d] for k, d in self.by_type.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.by_type = {k: deque(Group.from_state(g) for g in d) for k, d in state["by_type"].items()}
