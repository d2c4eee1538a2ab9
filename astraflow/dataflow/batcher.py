"""Batch assembly for one policy: finished groups -> Batches of ``groups_per_batch`` groups, with the
batch-serving plug-in choosing which groups (FIFO, replay, mixing)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from astraflow.dataflow.group import Group
from astraflow.dataflow.plugins import BatchSampler
from astraflow.records import Batch


class BatchAssembler:
    def __init__(self, policy: str, groups_per_batch: int, sampler: BatchSampler) -> None:
        self.policy = policy
        self.groups_per_batch = groups_per_batch
        self.sampler = sampler
        self.seq = 0
        self.counters: Counter[str] = Counter()

    def add(self, group: Group) -> None:
        if group.policy != self.policy:
            raise ValueError(f"group {group.group_id} of policy {group.policy!r} routed to {self.policy!r}")
        self.sampler.add(group)
        self.counters["groups_in"] += 1

    def take(self, trainer_version: int, limit: int | None = None) -> list[Batch]:
        """Every batch that can be assembled now (at most ``limit``). Batch ids are sequential per
        policy and part of the checkpoint, so a batch re-produced after a crash carries the id the
        trainer already saw."""
        out: list[Batch] = []
        while (limit is None or len(out) < limit) and (groups := self.sampler.sample(self.groups_per_batch)) is not None:
            batch_id = f"{self.policy}-{self.seq:08d}"
            self.seq += 1
            trajs = [t for g in groups for t in g.trajectories]
            for g in groups:
                if g.served:
                    self.counters["groups_replayed"] += 1
                else:
                    self.counters["groups_batched"] += 1
                    self.counters["trajectories_batched"] += len(g.trajectories)
                g.served += 1
            self.counters["batches"] += 1
            out.append(Batch(batch_id, self.policy, trainer_version, trajs))
        return out

    def served(self, batch_id: str) -> bool:
        """True if ``batch_id`` is one of the batches this assembler (in its current state) served."""
        prefix = f"{self.policy}-"
        if not batch_id.startswith(prefix) or not batch_id[len(prefix):].isdigit():
            return False
        return int(batch_id[len(prefix):]) < self.seq

    def state_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "counters": dict(self.counters),
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.seq = s["seq"]
        self.counters = Counter(s["counters"])
        self.sampler.load_state_dict(s["sampler"])
