"""Task emission: dataset -> selector -> tasks tagged with the current weight version, under
backpressure.

In-flight tasks (emitted, not yet finished or expired) are bounded by ``in_flight_cap``; a task
finishes when every policy it feeds has had its group finalised (trained or dropped by a counted
rule). The dataset position, candidate pool and in-flight table are checkpointed, so a restarted
dataflow neither skips nor re-emits prompts beyond what the log redelivers.

Each in-flight task remembers where its record landed on the log (``position``, set when the broker
acknowledges it), so that a resumed dataflow can tell which of them the log has lost and re-emit
those (:meth:`TaskEmitter.reemit`, counted ``reemitted_lost``) instead of waiting for them to expire.
Tasks its lost life emitted after the state it resumes from are read back from the log and taken in
flight as they were sent (:meth:`TaskEmitter.adopt`, counted ``adopted``), so the nodes' work on them
is trained instead of dropped, and they are not drawn again.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from astraflow.dataflow.plugins import TaskSelector
from astraflow.dataflow.plugins.selectors import SOURCE_ID_KEY
from astraflow.records import Task

LogPosition = tuple[str, int, int]
"""(topic, partition, offset) of a task record."""


@dataclass(frozen=True, slots=True)
class AheadRoom:
    """Async: room to emit tasks for a version the trainer has not announced yet (``Dataflow.ahead_room``).

    Such a task is tagged with the oldest version its group may be generated at and still be trained
    within the staleness bound, never beyond the version the trainer reaches once it has trained every
    batch served so far. A node starts it when that version is served, so the task is on the node,
    waiting, when the version is announced, instead of following the announcement through the dataflow."""

    versions: dict[str, int]
    """Per policy, the version the served batches will produce (the newest tag)."""
    needed: Callable[[str, int], int]
    """``needed(policy, i)``: the oldest version the i-th task emitted in this call may start at."""
    room: int
    """Tasks the staleness bound allows when counted at ``versions`` (at least the plain room)."""
    cap: int
    """Most tasks in flight tagged above their announced version: however far the trainer lags, the
    nodes hold no more tasks they cannot start yet."""


@dataclass(slots=True)
class InFlight:
    task: Task
    emitted_at: float
    pending_policies: set[str] = field(default_factory=set)
    position: LogPosition | None = None
    """Where the broker acknowledged the task record; None until then."""


class TaskEmitter:
    def __init__(
        self,
        dataset: Iterable[Task],
        selector: TaskSelector,
        *,
        policies: list[str],
        in_flight_cap: int,
        candidate_pool: int = 64,
        epochs: int | None = None,
        mode: Literal["async", "sync"] = "async",
        wave_size: int | None = None,
        route_pools: dict[str, int] | None = None,
    ) -> None:
        self.dataset = dataset
        self.selector = selector
        self.policies = list(policies)
        self.in_flight_cap = in_flight_cap
        self.candidate_pool = candidate_pool
        self.epochs = epochs
        self.mode = mode
        self.wave_size = wave_size or in_flight_cap
        self.route_pools = dict(route_pools or {})
        self.versions = {p: 0 for p in self.policies}
        self.in_flight: dict[str, InFlight] = {}
        self.candidates: list[Task] = []
        self.epoch = 0
        self.position = 0
        """Tasks drawn from the dataset in the current epoch."""
        self.exhausted = False
        self.adopted: set[str] = set()
        """Prompt ids adopted (see :meth:`adopt`) that the dataset cursor has not passed yet: skipped when drawn."""
        self.counters: Counter[str] = Counter()
        # sync mode: version the current wave was emitted for, and tasks still owed to it
        self.wave_version = -1
        self.wave_shortfall = 0
        # async mode: further tasks the staleness bound allows (set by the Dataflow before each call)
        self.staleness_room: int | None = None
        self.ahead: AheadRoom | None = None
        # both modes: further tasks the run's remaining batches need (set by the Dataflow; None: no end known)
        self.run_room: int | None = None
        self._it: Iterator[Task] | None = None

    # -- versions ----------------------------------------------------------------------------
    def set_version(self, policy: str, version: int) -> None:
        if version > self.versions.get(policy, -1):
            self.versions[policy] = version
            self.selector.on_version(policy, version)

    def version_for(self, task: Task, versions: dict[str, int] | None = None) -> int:
        """The version ``task`` waits for: its policy's (all policies' oldest for a task that names
        none) in ``versions``, by default the announced ones."""
        versions = self.versions if versions is None else versions
        if task.policy:
            return versions.get(task.policy, 0)
        return min(versions.values())

    def _ahead_version(self, task: Task, i: int) -> int:
        """The tag of the i-th task of this call when it is emitted ahead of the announced version."""
        assert self.ahead is not None
        pols = [p for p in ([task.policy] if task.policy else self.versions) if p in self.ahead.versions]
        if not pols:  # a policy the recipe lacks: its trajectories are refused at ingest anyway
            return self.version_for(task)
        needed = min(self.ahead.needed(p, i) for p in pols)
        return min(max(needed, self.version_for(task)), self.version_for(task, self.ahead.versions))

    def _ahead_room(self) -> int:
        """Tasks that may be tagged ahead of the announced version now (0 without ``ahead``)."""
        if self.ahead is None or self.staleness_room is None:
            return 0
        waiting = sum(1 for f in self.in_flight.values() if f.task.emitted_version > self.version_for(f.task))
        return max(0, min(self.ahead.room - self.staleness_room, self.ahead.cap - waiting))

    # -- emission ----------------------------------------------------------------------------
    def capacity(self) -> int:
        """How many tasks may be emitted now."""
        k = self._mode_capacity()
        return k if self.run_room is None else max(0, min(k, self.run_room))

    def _mode_capacity(self) -> int:
        if self.mode == "async":
            room = self.in_flight_cap - len(self.in_flight)
            if self.staleness_room is not None:
                room = min(room, max(0, self.staleness_room) + self._ahead_room())
            return max(0, room)
        if self.in_flight:
            return 0
        current = min(self.versions.values())
        if current > self.wave_version:
            return self.wave_size
        return self.wave_shortfall

    def _draw(self) -> Task | None:
        while not self.exhausted:
            if self._it is None:
                self._it = iter(self.dataset)
                for _ in range(self.position):  # resume mid-epoch: datasets are deterministic
                    next(self._it)
            try:
                t = next(self._it)
            except StopIteration:
                self._it = None
                if self.position == 0:  # an empty dataset would loop forever
                    self.exhausted = True
                    return None
                self.epoch += 1
                self.position = 0
                # An id adopted from an earlier epoch can no longer be drawn (ids carry their epoch).
                self.adopted = {pid for pid in self.adopted if pid.endswith(f"~e{self.epoch}")}
                if self.epochs is not None and self.epoch >= self.epochs:
                    self.exhausted = True
                continue
            self.position += 1
            meta = {**t.metadata, SOURCE_ID_KEY: t.metadata.get(SOURCE_ID_KEY, t.prompt_id)}
            # Ids stay unique across epochs, so episode-id dedup never hits a legitimate re-run.
            pid = t.prompt_id if self.epoch == 0 else f"{t.prompt_id}~e{self.epoch}"
            if pid in self.adopted:  # emitted by a lost life after the state this one resumed from
                self.adopted.discard(pid)
                continue
            return dataclasses.replace(t, prompt_id=pid, metadata=meta)
        return None

    def next_tasks(self, now: float) -> list[Task]:
        """Tasks to send now, tagged with the current version and registered as in flight."""
        k = self.capacity()
        if k <= 0:
            return []
        # The first ``plain`` tasks are tagged with the announced version; any beyond it (``ahead``), with
        # the oldest later version at which their place in line keeps them within the staleness bound.
        plain = k if self.staleness_room is None else max(0, self.staleness_room)
        out: list[Task] = []
        # Loop because a selector may skip candidates: refill and ask again until k are chosen.
        while len(out) < k:
            while len(self.candidates) < max(self.candidate_pool, k):
                t = self._draw()
                if t is None:
                    break
                self.candidates.append(t)
            emit, skip = self.selector.select(list(self.candidates), k - len(out))
            emit = emit[: k - len(out)]
            if not emit and not skip:
                break
            gone = {id(t) for t in emit} | {id(t) for t in skip}
            self.candidates = [t for t in self.candidates if id(t) not in gone]
            self.counters["selector_skipped"] += len(skip)
            for t in emit:
                ahead = self.ahead is not None and len(out) >= plain
                t = dataclasses.replace(
                    t, emitted_version=self._ahead_version(t, len(out)) if ahead else self.version_for(t))
                if self.route_pools:
                    t = dataclasses.replace(t, pool=self._freest_pool())
                if t.prompt_id in self.in_flight:  # a dataset with repeated ids: count, never clobber
                    self.counters["duplicate_prompt_id"] += 1
                    continue
                pols = {t.policy} if t.policy else set(self.policies)
                self.in_flight[t.prompt_id] = InFlight(t, now, pols)
                out.append(t)
        self.counters["emitted"] += len(out)
        if self.mode == "sync":
            current = min(self.versions.values())
            self.wave_version = max(self.wave_version, current)
            self.wave_shortfall = 0
        return out

    def _freest_pool(self) -> str:
        busy = Counter(f.task.pool for f in self.in_flight.values())
        return max(self.route_pools, key=lambda p: self.route_pools[p] - busy[p])

    # -- completion --------------------------------------------------------------------------
    def task(self, prompt_id: str) -> Task | None:
        f = self.in_flight.get(prompt_id)
        return f.task if f else None

    def group_done(self, task_id: str, policy: str) -> bool:
        """A group of ``task_id`` was finalised; returns True when that finished the task."""
        f = self.in_flight.get(task_id)
        if f is None:
            return False
        f.pending_policies.discard(policy)
        if f.pending_policies:
            return False
        del self.in_flight[task_id]
        self.counters["finished"] += 1
        return True

    def placed(self, prompt_id: str, position: LogPosition) -> None:
        """The broker acknowledged ``prompt_id``'s task record at ``position``."""
        f = self.in_flight.get(prompt_id)
        if f is not None:
            f.position = position

    def adopt(self, task: Task, position: LogPosition, now: float) -> bool:
        """Take in flight a task that a lost life of this dataflow emitted after the state this one
        resumed from, as its record on the log says (version tag and pool included): its trajectories
        are then ingested instead of dropped as ``unknown_task``, and it is not drawn again. False for
        a task already in flight (a re-emitted one). Counted ``emitted`` and ``adopted``."""
        if task.prompt_id in self.in_flight:
            return False
        pols = {task.policy} if task.policy else set(self.policies)
        self.in_flight[task.prompt_id] = InFlight(task, now, pols, position)
        before = len(self.candidates)
        self.candidates = [t for t in self.candidates if t.prompt_id != task.prompt_id]
        if len(self.candidates) == before:  # drawn beyond the saved cursor: skip it when the cursor gets there
            self.adopted.add(task.prompt_id)
        if self.mode == "sync":  # the wave it belongs to was emitted: do not emit that version's wave again
            self.wave_version = max(self.wave_version, task.emitted_version)
            self.wave_shortfall = 0
        self.counters["emitted"] += 1
        self.counters["adopted"] += 1
        return True

    def reemit(self, prompt_ids: Iterable[str], now: float) -> list[Task]:
        """In-flight tasks whose records the log lost, to send again as they were: still in flight
        (their groups and pending policies unchanged), their timeout restarted, counted
        ``reemitted_lost``."""
        out = []
        for pid in prompt_ids:
            f = self.in_flight.get(pid)
            if f is None:
                continue
            f.emitted_at, f.position = now, None
            out.append(f.task)
        self.counters["reemitted_lost"] += len(out)
        return out

    def expire(self, now: float, timeout_s: float | None) -> list[Task]:
        """Remove tasks in flight for longer than ``timeout_s``; counted ``expired``."""
        if timeout_s is None:
            return []
        old = [pid for pid, f in self.in_flight.items() if now - f.emitted_at > timeout_s]
        out = [self.in_flight.pop(pid).task for pid in old]
        self.counters["expired"] += len(out)
        return out

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "versions": dict(self.versions),
            "in_flight": [
                {"task": dataclasses.asdict(f.task), "emitted_at": f.emitted_at, "pending": sorted(f.pending_policies),
                 "position": list(f.position) if f.position else None}
                for f in self.in_flight.values()
            ],
            "candidates": [dataclasses.asdict(t) for t in self.candidates],
            "epoch": self.epoch,
            "position": self.position,
            "exhausted": self.exhausted,
            "adopted": sorted(self.adopted),
            "counters": dict(self.counters),
            "wave_version": self.wave_version,
            "wave_shortfall": self.wave_shortfall,
            "selector": self.selector.state_dict(),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.versions.update(s["versions"])
        self.in_flight = {}
        for f in s["in_flight"]:
            t = Task(**f["task"])
            pos = f.get("position")
            self.in_flight[t.prompt_id] = InFlight(t, f["emitted_at"], set(f["pending"]),
                                                   (pos[0], int(pos[1]), int(pos[2])) if pos else None)
        self.candidates = [Task(**t) for t in s["candidates"]]
        self.epoch, self.position, self.exhausted = s["epoch"], s["position"], s["exhausted"]
        self.adopted = set(s.get("adopted", ()))
        self.counters = Counter(s["counters"])
        self.wave_version, self.wave_shortfall = s["wave_version"], s["wave_shortfall"]
        self.selector.load_state_dict(s["selector"])
        self._it = None
