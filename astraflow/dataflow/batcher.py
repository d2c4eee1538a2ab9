"""Batch assembly for one policy: finished groups -> Batches of ``groups_per_batch`` groups, with the
batch-serving plug-in choosing which groups (FIFO, replay, mixing)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from astraflow.dataflow.plugins import BatchSampler
from astraflow.dataflow.plugins.group import Group
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
            # In group-id order, not arrival order: what a batch holds and in which order (its
            # minibatches) then does not depend on which node answered first (a sync run's wave).
            groups = sorted(groups, key=lambda g: g.group_id)
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
        seq = self.seq_of(batch_id)
        return seq is not None and seq < self.seq

    def seq_of(self, batch_id: str) -> int | None:
        """The sequence number in one of this assembler's batch ids; None for another id."""
        prefix = f"{self.policy}-"
        if not batch_id.startswith(prefix) or not batch_id[len(prefix):].isdigit():
            return None
        return int(batch_id[len(prefix):])

    def withdraw(self, group_ids: set[str]) -> list[Group]:
        """Take the buffered groups in ``group_ids`` out of the sampler; the others keep their order."""
        out, keep = [], []
        for g in self.sampler.drain():
            (out if g.group_id in group_ids else keep).append(g)
        for g in keep:
            self.sampler.add(g)
        return out

    def adopt(self, batch_id: str, groups: int, trajectories: int, replayed: int) -> None:
        """Count a batch that a lost life of the dataflow served after the state this one resumed from
        (``groups`` fresh groups of ``trajectories`` trajectories, ``replayed`` groups served before);
        the next batch gets the id after it."""
        seq = self.seq_of(batch_id)
        if seq is None:
            raise ValueError(f"{batch_id!r} is not a batch id of policy {self.policy!r}")
        self.seq = max(self.seq, seq + 1)
        self.counters["batches"] += 1
        self.counters["groups_batched"] += groups
        self.counters["trajectories_batched"] += trajectories
        self.counters["groups_replayed"] += replayed

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
