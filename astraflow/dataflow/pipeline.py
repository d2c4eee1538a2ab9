"""The whole dataflow as one pure object: emitter + processor + one batcher per policy.

No I/O here: :mod:`astraflow.dataflow.service` feeds it log records and sends what it returns.
Its ``state_dict`` (plug-in state included) is checkpointed together with the consumed offsets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from astraflow.dataflow.batcher import BatchAssembler
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.emitter import AheadRoom, TaskEmitter
from astraflow.dataflow.plugins import build_plugin
from astraflow.dataflow.processor import TrajectoryProcessor
from astraflow.records import Batch, Task, Trajectory

STATE_VERSION = 1


class Dataflow:
    def __init__(self, cfg: DataflowConfig, dataset: Iterable[Task], *, train_steps: int | None = None) -> None:
        """``train_steps``: the batches each policy's trainer trains in this run (``trainer.steps``); the
        dataflow then emits no task beyond what those batches need (:meth:`run_room`). None: no end known."""
        self.cfg = cfg
        self.train_steps = train_steps
        self.emitter = TaskEmitter(
            dataset,
            build_plugin("selector", cfg.selector),
            policies=cfg.policies,
            in_flight_cap=cfg.in_flight_cap,
            candidate_pool=cfg.candidate_pool,
            epochs=cfg.epochs,
            mode=cfg.mode,
            wave_size=cfg.groups_per_batch,
            route_pools=cfg.route_pools,
        )
        # Before the processor: its staleness rule (train_version) reads the batchers.
        self.batchers = {
            p: BatchAssembler(p, cfg.groups_per_batch, build_plugin("sampler", cfg.sampler)) for p in cfg.policies
        }
        self.processor = TrajectoryProcessor(
            policies=cfg.policies,
            max_staleness=cfg.max_staleness,
            stale_tokens=cfg.stale_tokens,
            filters=[build_plugin("filter", f) for f in cfg.filters],
            task_lookup=self.emitter.task,
            version_of=self.train_version,
            task_in_flight=lambda task_id: task_id in self.emitter.in_flight,  # in_flight is replaced on load
            dedup_window=cfg.dedup_window_tasks,
            dedup_capacity=cfg.dedup_capacity,
            min_group_samples=cfg.min_group_samples,
        )
        self._batched_this_wave: set[str] = set()
        self._base_version: dict[str, int] = {}
        """Per policy, the announced version when this dataflow served its first batch."""

    def train_version(self, policy: str, version: int | None = None) -> int:
        """The version that will train a group finishing now (staleness is measured against it).

        Batches are trained in order, one version each, so a group that joins the FIFO queue
        behind ``buffered`` groups and ``batches`` already served is trained at
        ``base + batches + buffered // B`` — later than the latest announced version whenever
        batches queue at a slow trainer. Measuring against the announced version alone would let a
        long-tail episode that finishes late, behind a queue, be trained beyond ``max_staleness``.
        ``version`` (the oldest token version of the trajectory being judged) lets a sampler that does
        not serve in arrival order say how many buffered groups go first (``BatchSampler.ahead_of``).
        """
        announced = self.emitter.versions.get(policy, 0)
        b = self.batchers.get(policy)
        if b is None or self.cfg.max_in_flight is not None:
            return announced  # an explicit in-flight cap keeps the plain rule (see DataflowConfig)
        base = self._base_version.get(policy, announced)
        ahead = b.sampler.buffered() if version is None else b.sampler.ahead_of(version)
        return max(announced, base + b.counters["batches"] + ahead // self.cfg.groups_per_batch)

    @property
    def versions(self) -> dict[str, int]:
        return self.emitter.versions

    def on_weights(self, policy: str, version: int, batch_id: str | None = None) -> None:
        """A ``weights.<policy>`` announcement; ``batch_id``: the last batch trained into it, which
        re-anchors the staleness accounting (:meth:`batch_trained`) before the version opens room."""
        if batch_id is not None:
            self.batch_trained(policy, batch_id, version)
        if policy in self.emitter.versions:
            before = min(self.versions.values())
            self.emitter.set_version(policy, version)
            if min(self.versions.values()) > before:
                self._batched_this_wave.clear()

    def staleness_room(self, versions: dict[str, int] | None = None,
                       groups_ahead: dict[str, int] | None = None) -> int:
        """Tasks that may still be emitted without any of them being trained beyond ``max_staleness``.

        Policy p's groups are trained in arrival order, ``groups_per_batch`` per version: the group
        at position g (groups batched + buffered + in flight before it) is trained by version
        ``base + g // B``. Its tokens are at least the emission version v (a node serves a task
        only once it loaded ``emitted_version``), so staleness <= η holds iff
        g < (v - base + η + 1) * B (a group finishing out of order, behind the queue, is caught by
        the ingest filter against :meth:`train_version`); ``emission_slack`` versions of η are kept
        free for such groups. ``versions``: the emission version v per policy (default: the announced
        ones; :meth:`ahead_room` counts at the versions the served batches will produce);
        ``groups_ahead``: :meth:`_groups_ahead`, when the caller has it already. In-flight
        alone cannot guarantee this: when the trainer is the bottleneck, finished groups queue up as
        batches and the emitter would keep refilling (every queued batch adds a version of lag).
        """
        B, eta = self.cfg.groups_per_batch, self.cfg.max_staleness - self.cfg.emission_slack
        room = None
        groups_ahead = self._groups_ahead() if groups_ahead is None else groups_ahead
        for p, ahead in groups_ahead.items():
            base = self._base_version.get(p, self.versions[p])  # version that trains batch 0
            v = self.versions[p] if versions is None else versions[p]
            r = (v - base + eta + 1) * B - ahead
            room = r if room is None else min(room, r)
        return max(0, room or 0)

    def served_version(self, policy: str) -> int:
        """The version ``policy``'s trainer reaches once it has trained every batch served so far (the
        announced one when that is newer: a restarted trainer publishes its checkpoint as a new version)."""
        announced = self.versions[policy]
        base = self._base_version.get(policy)
        b = self.batchers.get(policy)
        if base is None or b is None:
            return announced
        return max(announced, base + b.counters["batches"])

    def ahead_room(self, groups_ahead: dict[str, int] | None = None) -> AheadRoom | None:
        """Room to emit for versions not announced yet (``DataflowConfig.emit_ahead``): a batch served
        is a version coming, so its successors' tasks can be on the nodes before it is announced."""
        if not self.cfg.emit_ahead or not self.batchers:
            return None
        served = {p: self.served_version(p) for p in self.versions}
        B, eta = self.cfg.groups_per_batch, self.cfg.max_staleness - self.cfg.emission_slack
        first = self._groups_ahead() if groups_ahead is None else groups_ahead

        def needed(p: str, i: int) -> int:
            # The group at position g is trained by base + g // B, so it may start at that minus eta.
            return self._base_version.get(p, self.versions[p]) + (first[p] + i) // B - eta

        return AheadRoom(served, needed, self.staleness_room(served, first), eta * B)

    def _groups_ahead(self) -> dict[str, int]:
        """Per policy, the groups that train before the next task's: batched, buffered and in flight
        (one pass over the in-flight table for all policies)."""
        ahead = {p: b.counters["groups_batched"] + b.sampler.buffered() for p, b in self.batchers.items()}
        for f in self.emitter.in_flight.values():
            for p in f.pending_policies:
                if p in ahead:
                    ahead[p] += 1
        return ahead

    def run_room(self, groups_ahead: dict[str, int] | None = None) -> int | None:
        """Tasks that may still be emitted before the groups buffered and in flight fill every batch the
        trainers will still train, and one batch's worth more (None without ``train_steps``). Once they
        are out, the pipeline's overhang (up to ``max_staleness`` batches ahead of the trainer, a wave
        in sync mode) is not generated only to be thrown away when the run ends. The spare batch's worth
        fills the last batches with whichever groups finish first: without it, each group dropped near
        the end (stale, filtered) was replaced by a task emitted only then, and the trainer waited a
        whole rollout for it (the last step of ``benchmarks/async_vs_sync.py``'s two-policy run: 2.4 s).

        Per policy, the batches to make are ``train_steps`` plus the served ones the trainer will not
        train (skipped, lost with the log) less those served; a task counts for every policy it feeds,
        so it may be emitted while any policy still needs groups. A group dropped, a batch skipped or
        lost gives its room back. Counted as if every batch were fresh groups: a sampler that replays
        needs fewer."""
        if self.train_steps is None or not self.batchers:
            return None
        B = self.cfg.groups_per_batch
        groups_ahead = self._groups_ahead() if groups_ahead is None else groups_ahead
        room = 0
        for p, b in self.batchers.items():
            c = b.counters
            to_make = self.train_steps + c["skipped_by_trainer"] + c["lost_untrained"] - c["batches"]
            if to_make > 0:  # groups buffered and in flight count against it
                room = max(room, (to_make + 1) * B - (groups_ahead[p] - c["groups_batched"]))
        return room

    def next_tasks(self, now: float) -> list[Task]:
        groups_ahead = self._groups_ahead()
        self.emitter.run_room = self.run_room(groups_ahead)
        if self.cfg.mode == "async" and self.cfg.max_in_flight is None:
            # An explicit max_in_flight is a plain cap (the ingest filter still drops stale tokens).
            self.emitter.staleness_room = self.staleness_room(groups_ahead=groups_ahead)
            self.emitter.ahead = self.ahead_room(groups_ahead)
        if self.cfg.mode == "sync" and not self.emitter.in_flight:
            # The wave is finished; if filters left a policy short of a batch, top it up at the
            # same version instead of waiting for weights that cannot come.
            short = [
                self.cfg.groups_per_batch - b.sampler.buffered()
                for p, b in self.batchers.items()
                if p not in self._batched_this_wave
            ]
            self.emitter.wave_shortfall = max(short, default=0)
        return self.emitter.next_tasks(now)

    def ingest(self, trajectories: Iterable[Trajectory]) -> None:
        for traj in trajectories:
            for res in self.processor.ingest(traj):
                g = res.group
                task = self.emitter.task(g.task_id)
                if task is not None:
                    self.emitter.selector.observe(task, g.policy, g.rewards)
                if res.kept:
                    self.batchers[g.policy].add(g)
                self._group_done(g.task_id, g.policy)

    def _group_done(self, task_id: str, policy: str) -> None:
        if self.emitter.group_done(task_id, policy):
            self.processor.task_left(task_id)

    def refuse_record(self) -> None:
        """A trajectory record whose rows break the record contract: counted, never ingested."""
        self.processor.counters["invalid_records"] += 1

    def in_flight_pool(self, task_id: str) -> str | None:
        """The pool of an in-flight task; None for a task not in flight (finished, expired, unknown)."""
        inflight = self.emitter.task(task_id)
        return None if inflight is None else inflight.pool

    def in_flight_pools(self) -> set[str]:
        """The pools that in-flight tasks were sent to."""
        return {f.task.pool for f in self.emitter.in_flight.values()}

    def task_placed(self, prompt_id: str, position: tuple[str, int, int]) -> None:
        """The broker acknowledged the task's record at ``(topic, partition, offset)``."""
        self.emitter.placed(prompt_id, position)

    def expire(self, now: float) -> list[Task]:
        expired = self.emitter.expire(now, self.cfg.task_timeout_s)
        for t in expired:
            self.processor.discard_task(t.prompt_id)
        return expired

    def batches_lost(self, policy: str, version: int) -> None:
        """The log lost ``policy``'s batch topic (a resumed run on a fresh log): batches served but
        not trained yet will never be trained. Re-base the staleness accounting so that the next
        batch counts as trained by ``version`` (the latest the weight store has): without it the
        emitter would wait for versions that the lost batches were to produce, and never get them."""
        if policy not in self.batchers:
            return
        b = self.batchers[policy]
        if policy in self._base_version:  # served, neither trained (as far as announced) nor skipped: gone
            untrained = b.counters["batches"] - (self.versions[policy] - self._base_version[policy])
            b.counters["lost_untrained"] += max(0, untrained)
        self.emitter.set_version(policy, version)
        self._base_version[policy] = self.versions[policy] - b.counters["batches"]
        if self.cfg.mode == "sync":  # the wave's batch is gone: the next wave is for the current version
            self._batched_this_wave.discard(policy)
            self.emitter.wave_version = -1

    def adopt_batch(self, b: Batch) -> bool:
        """A batch that a lost life of this dataflow served after the state this one resumed from (read
        back from the batch topic, :mod:`astraflow.dataflow.adoption`): its groups count as kept and
        served, leave the sampler and the pending table, and finish their tasks; their episodes are
        remembered, so the copies read again are not judged again (the first not received again, any
        further one a duplicate); the next batch gets the next id. Without it the batch would be made again under its id, and the trainer, which trained
        that id, would skip it. False for a batch this state served already."""
        asm = self.batchers.get(b.policy)
        if asm is None or asm.seq_of(b.batch_id) is None or asm.served(b.batch_id) or not b.trajectories:
            return False
        groups: dict[str, list[Trajectory]] = {}
        for t in b.trajectories:
            groups.setdefault(t.group_id, []).append(t)
        self._base_version.setdefault(b.policy, self.versions[b.policy] - asm.counters["batches"])
        buffered = {g.group_id for g in asm.withdraw(set(groups))}  # kept and counted in this state already
        fresh = trajectories = 0
        for group_id, trajs in groups.items():
            if group_id in buffered or self.processor.adopt_group(trajs):
                fresh += 1
                trajectories += len(trajs)
                self._group_done(trajs[0].task_id, b.policy)
        asm.adopt(b.batch_id, fresh, trajectories, len(groups) - fresh)
        self._batched_this_wave.add(b.policy)
        return True

    def batch_trained(self, policy: str, batch_id: str, version: int) -> bool:
        """``version`` holds the weights trained through ``batch_id`` (its announcement says so). The
        staleness accounting takes the i-th batch served to be trained into ``base + i + 1``; this
        re-anchors ``base`` on what the trainer did. A trainer restarted from an older checkpoint breaks
        the rule: it publishes its checkpoint under a fresh version and trains the batches after it
        again, each into a new version, so the announced versions run ahead of the batches served, and
        the staleness bound would let the dataflow emit that many batches' worth of tasks more than
        the trainer will take. False (nothing changed) for a batch this state did not serve."""
        asm = self.batchers.get(policy)
        seq = None if asm is None else asm.seq_of(batch_id)
        if seq is None or seq >= asm.seq:
            return False
        self._base_version[policy] = version - (seq + 1)
        return True

    def batch_skipped(self, policy: str, batch_id: str) -> bool:
        """The trainer skipped ``batch_id`` as a duplicate: a batch this dataflow served trains no
        version. Happens after a restart from a checkpoint older than the batches the lost life
        served: the re-produced batches carry ids the trainer already trained (that is how nothing
        is trained twice). Without this, each skip would cost the staleness bound one version that
        never comes, and the emitter would stall. Returns False (nothing changed) for a batch not
        served in this state: its own skip will be reported once it is."""
        b = self.batchers.get(policy)
        if b is None or not b.served(batch_id):
            return False
        b.counters["skipped_by_trainer"] += 1
        if policy in self._base_version:
            self._base_version[policy] -= 1
        if self.cfg.mode == "sync":  # the wave's batch trains no version: top the wave up instead
            self._batched_this_wave.discard(policy)
        return True

    def take_batches(self) -> list[Batch]:
        out = []
        for p, b in self.batchers.items():
            if b.sampler.buffered() >= self.cfg.groups_per_batch:
                self._base_version.setdefault(p, self.versions[p] - b.counters["batches"])
            batches = b.take(self.versions[p], limit=self._batches_wanted(p))
            if batches:
                self._batched_this_wave.add(p)
            out += batches
        return out

    def _batches_wanted(self, policy: str) -> int | None:
        """How many batches of ``policy`` may be served now: all that are full (``None``), or, with
        ``batch_lookahead``, only enough to keep that many untrained ahead of the trainer (the
        announced version tells how many it trained). Groups wait in the sampler meanwhile, where
        a sampler such as ``oldest_first`` can still put a late old group before newer ones."""
        if self.cfg.batch_lookahead is None or policy not in self._base_version:
            return None
        untrained = self.batchers[policy].counters["batches"] - (self.versions[policy] - self._base_version[policy])
        return max(0, self.cfg.batch_lookahead - untrained)

    @property
    def finished(self) -> bool:
        """Dataset exhausted and nothing in flight (a finite run is over)."""
        return self.emitter.exhausted and not self.emitter.candidates and not self.emitter.in_flight

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {f"tasks.{k}": v for k, v in self.emitter.counters.items()}
        out["tasks.in_flight"] = len(self.emitter.in_flight)
        out.update({f"trajectories.{k}": v for k, v in self.processor.counters.items()})
        out["trajectories.pending"] = self.processor.pending_trajectories()
        for p, b in self.batchers.items():
            out.update({f"batches.{p}.{k}": v for k, v in b.counters.items()})
            out[f"batches.{p}.groups_buffered"] = b.sampler.buffered()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "state_version": STATE_VERSION,
            "emitter": self.emitter.state_dict(),
            "processor": self.processor.state_dict(),
            "batchers": {p: b.state_dict() for p, b in self.batchers.items()},
            "batched_this_wave": sorted(self._batched_this_wave),
            "base_version": dict(self._base_version),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        if s.get("state_version") != STATE_VERSION:
            raise ValueError(f"dataflow checkpoint state_version {s.get('state_version')} != {STATE_VERSION}")
        if set(s["batchers"]) != set(self.batchers):
            raise ValueError(f"checkpoint policies {sorted(s['batchers'])} != recipe policies {sorted(self.batchers)}")
        self.emitter.load_state_dict(s["emitter"])
        self.processor.load_state_dict(s["processor"])
        for p, b in self.batchers.items():
            b.load_state_dict(s["batchers"][p])
        self._batched_this_wave = set(s["batched_this_wave"])
        self._base_version = dict(s.get("base_version", {}))
