"""Trajectory processing: dedup, staleness, group assembly, rollout filters, routing by policy.

Every trajectory received ends in exactly one counter bucket (``duplicate``, ``unknown_task``,
``unknown_policy``, ``stale``, ``expired``, ``in_dropped_group``, ``kept``) or is still pending in
an unfinished group, so "every trajectory is trained on or dropped by a counted rule" is checkable
(:meth:`TrajectoryProcessor.unaccounted`). With ``stale_tokens="mask"`` a trajectory whose early
tokens are too stale is kept with those tokens masked out of the loss (``partly_stale``, and
``stale_tokens_masked`` tokens; it is counted ``kept`` or dropped with its group as usual).
A copy is recognised by its episode id: every one of a task in flight, then those of a window of the
tasks that left flight last (:mod:`astraflow.dataflow.dedup`), so the saved state does not grow with
the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from astraflow.dataflow.dedup import EpisodeMemory
from astraflow.dataflow.plugins import TrajectoryFilter
from astraflow.dataflow.plugins.group import Group
from astraflow.records import Task, Trajectory


@dataclass(slots=True)
class GroupResult:
    """A finalised group: ``kept`` groups go to their policy's batcher; others were dropped for
    ``reason`` (``group_too_small`` or ``filter:<name>``)."""

    group: Group
    kept: bool
    reason: str = ""


class TrajectoryProcessor:
    def __init__(
        self,
        *,
        policies: list[str],
        max_staleness: int,
        filters: list[TrajectoryFilter],
        stale_tokens: str = "drop",
        task_lookup: Callable[[str], Task | None],
        version_of: Callable[[str, int], int],
        task_in_flight: Callable[[str], bool] = lambda task_id: False,
        dedup_window: int = 1024,
        dedup_capacity: int = 200_000,
        min_group_samples: int = 2,
    ) -> None:
        """``task_in_flight(task_id)``: whether the task emitter tracks the task as in flight (then
        :meth:`task_left` says when it leaves); ``dedup_window``, ``dedup_capacity``: what
        :class:`~astraflow.dataflow.dedup.EpisodeMemory` keeps of the episodes of other tasks."""
        self.policies = set(policies)
        self.max_staleness = max_staleness
        self.stale_tokens = stale_tokens
        self.filters = filters
        self.task_lookup = task_lookup
        self.version_of = version_of
        self.min_group_samples = min_group_samples
        self.seen = EpisodeMemory(in_flight=task_in_flight, window=dedup_window, capacity=dedup_capacity)
        self.pending: dict[str, Group] = {}
        self.counters: Counter[str] = Counter()
        self.adopted_unread: set[str] = set()
        """Episodes of adopted groups (:meth:`adopt_group`) whose trajectory records a resumed dataflow
        reads again (received by its lost life after the saved state): the adoption counted them, so
        their first copy read is not received again (the log holds them once; an archive's replay
        counts them once)."""

    def ingest(self, traj: Trajectory) -> list[GroupResult]:
        c = self.counters
        if traj.episode_id in self.adopted_unread:
            self.adopted_unread.discard(traj.episode_id)
            c["adopted_read_again"] += 1  # in no other counter: the adoption counted it received and kept
            return []
        c["received"] += 1
        if self.seen.seen(traj.task_id, traj.episode_id):
            c["duplicate"] += 1
            return []
        task = self.task_lookup(traj.task_id)
        if task is None:  # finished, expired, or not (yet, again) emitted by this run
            # Not remembered: a dataflow restarted from its checkpoint reads trajectories of tasks
            # its lost life emitted after that checkpoint before it emits them again (same prompt
            # ids, same episode ids). Remembering them would drop the re-run's trajectories as
            # duplicates and leave those tasks in flight until they expire.
            c["unknown_task"] += 1
            return []
        self.seen.remember(traj.task_id, traj.episode_id)
        if traj.policy not in self.policies or (task.policy and task.policy != traj.policy):
            c["unknown_policy"] += 1
            return []
        group = self.pending.get(traj.group_id)
        if group is None:
            group = Group(traj.group_id, traj.task_id, traj.policy, traj.task_type or task.task_type, task.samples)
            self.pending[traj.group_id] = group
        oldest = traj.min_version  # a property over the token lists: read once
        if self.version_of(traj.policy, oldest) - oldest > self.max_staleness and not (
                self.stale_tokens == "mask" and self._mask_stale_tokens(traj)):
            c["stale"] += 1
            group.dropped += 1
        else:
            group.trajectories.append(traj)
        if not group.complete:
            return []
        del self.pending[traj.group_id]
        group.trajectories.sort(key=lambda t: t.sample_index)
        return [self._finalise(group)]

    def _mask_stale_tokens(self, traj: Trajectory) -> bool:
        """Mask out of the loss the trained tokens of ``traj`` too stale to train; False (nothing
        changed) when none would be left.

        The floor is measured against the version that would train ``traj`` if it were judged by
        its *newest* trained token: a sampler serves a group no later for an older key, so once the
        stale tokens are masked (its oldest token is then at least the floor) it is trained no later
        than that version and every token it keeps is within ``max_staleness``."""
        mask, versions = traj.loss_mask, traj.versions
        newest = max((v for v, m in zip(versions, mask, strict=True) if m), default=None)
        if newest is None:
            return False
        floor = self.version_of(traj.policy, newest) - self.max_staleness
        keep = [1 if m and v >= floor else 0 for v, m in zip(versions, mask, strict=True)]
        if not any(keep):
            return False
        self.counters["partly_stale"] += 1
        self.counters["stale_tokens_masked"] += sum(mask) - sum(keep)
        traj.logprobs = [lp if k else 0.0 for lp, k in zip(traj.logprobs, keep, strict=True)]
        traj.loss_mask = keep
        return True

    def _finalise(self, group: Group) -> GroupResult:
        c = self.counters
        c["groups_finished"] += 1
        n = len(group.trajectories)
        reason = ""
        if n < self.min_group_samples:
            reason = "group_too_small"
        else:
            for f in self.filters:
                if not f.keep(group):
                    reason = f"filter:{f.name}"
                    break
        if reason:
            c[f"groups_dropped:{reason}"] += 1
            c["in_dropped_group"] += n
            return GroupResult(group, False, reason)
        c["groups_kept"] += 1
        c["kept"] += n
        return GroupResult(group, True)

    def adopt_group(self, trajectories: list[Trajectory]) -> bool:
        """One group of a batch that a lost life of the dataflow served after the state this one resumed
        from: counted as that life counted it (its trajectories received and kept, a group finished and
        kept) and its episodes remembered: the first copy of each read again is not received again
        (:attr:`adopted_unread`), any further copy is a duplicate. Its part pending
        in this state is in the batch. False, counting nothing, for a group not pending whose task is
        not in flight (the lost life finished it before the state was saved: its tasks emitted after
        that are adopted first) or whose every episode this state has seen: one served before (a replay)."""
        group_id = trajectories[0].group_id
        pending = self.pending.pop(group_id, None)
        if pending is None and (self.task_lookup(trajectories[0].task_id) is None
                                or all(self.seen.seen(t.task_id, t.episode_id) for t in trajectories)):
            return False
        c = self.counters
        c["received"] += len(trajectories) - (len(pending.trajectories) if pending else 0)
        c["kept"] += len(trajectories)
        c["groups_finished"] += 1
        c["groups_kept"] += 1
        for t in trajectories:
            if not self.seen.seen(t.task_id, t.episode_id):  # received after the save: read again next
                self.seen.remember(t.task_id, t.episode_id)
                self.adopted_unread.add(t.episode_id)
        return True

    def task_left(self, task_id: str) -> None:
        """The task emitter no longer has ``task_id`` in flight (every group finalised): its episodes
        are remembered only for the window of recent tasks (:mod:`astraflow.dataflow.dedup`)."""
        self.seen.task_left(task_id)

    def discard_task(self, task_id: str) -> int:
        """Drop the pending groups of an expired task; their trajectories are counted ``expired``."""
        gone = [gid for gid, g in self.pending.items() if g.task_id == task_id]
        n = 0
        for gid in gone:
            n += len(self.pending.pop(gid).trajectories)
        self.counters["expired"] += n
        self.seen.task_left(task_id)
        return n

    def pending_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.pending.values())

    def unaccounted(self) -> int:
        """Received trajectories in no counter and not pending: 0 unless there is a bug."""
        c = self.counters
        done = sum(c[k] for k in ("duplicate", "unknown_task", "unknown_policy", "stale", "expired",
                                  "in_dropped_group", "kept"))
        return c["received"] - done - self.pending_trajectories()

    def state_dict(self) -> dict[str, Any]:
        return {
            "episodes": self.seen.state_dict(),
            "pending": [g.to_state() for g in self.pending.values()],
            "counters": dict(self.counters),
            "filters": [f.state_dict() for f in self.filters],
            "adopted_unread": sorted(self.adopted_unread),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        if "episodes" in s:
            self.seen.load_state_dict(s["episodes"])
        else:  # saved before issue 28: one list of every episode id remembered
            self.seen.load_flat(s["seen"])
        self.pending = {g["group_id"]: Group.from_state(g) for g in s["pending"]}
        self.counters = Counter(s["counters"])
        self.adopted_unread = set(s.get("adopted_unread", ()))  # absent: saved before it was kept
        for f, fs in zip(self.filters, s["filters"], strict=True):
            f.load_state_dict(fs)
