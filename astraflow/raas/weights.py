"""A node's view of the weight plane: catch up before taking work, then follow announcements.

``WeightFollower`` owns one ``WeightSubscriber`` per policy and a background thread that reads
``<run>.weights.<policy>``. An announcement names its version: the follower pulls it (the nearest
anchor plus deltas, decided by the subscriber from the manifests after the version it holds, without
listing the bucket) and hands it to the policy's engine with ``Engine.update_weights``, which lands
between two decoding steps, as the cheapest update kind the engine accepts
(:mod:`astraflow.engines.weight_update`). Pulling and decoding happen on this thread, so generation
never waits for the bucket. An engine that fetches its weights itself (``PublishedVersion``: a vLLM
server, whose workers read the bucket) is only told the version. One that accepts ``InPlacePatch``
(the simulated engine, an HF model in the published dtype) is patched in place after its first load:
the deltas are fetched and decoded here, the engine pauses only while the changed entries are
written, checksums are verified after, and the follower keeps no copy of the weights of its own
(:mod:`astraflow.delta.patch`). Any other gets a ``FullState``.
A periodic check of the store covers announcements published before the follower joined.
With a ``region`` in the cluster config the bytes come from the regional replica of the bucket
(:mod:`astraflow.objstore.regional`): an announcement that outran replication is waited out or read
from the origin, as configured; a wait that times out leaves the node serving what it has until the
next check.
When the bucket or the broker does not answer, the follower waits for it (one log line per backoff
step, :class:`~astraflow.outage.OutageReport`) and the node keeps serving the weights it has.
A corrupt weight object is not an outage and not fatal either: the subscriber refuses it (logged,
counted in :attr:`WeightFollower.counters` as ``weights.refused.<reason>``) and plans around it; a
version that cannot be reached without it is skipped (one log line per version, counted as
``weights.unreachable``), the node keeps serving the newest version it has and tries again when a
newer one is published (typically the next anchor).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astraflow.engines.weight_update import FullState, InPlacePatch, PublishedVersion, UpdateRefusedError
from astraflow.log.handoff import HandoffLatency
from astraflow.records.control import WeightAnnouncement

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.engines import Engine
    from astraflow.log import LogConsumer
    from astraflow.outage import OutageReport

log = logging.getLogger(__name__)

RECORD_EVERY_S = 10.0
"""How often a node rewrites its subscriber record (the version it holds, for the weight GC) while it
refreshes: not at every version, which would be a PUT per node per trainer step. 60x inside the GC's
default subscriber TTL (600 s)."""


class WeightFollower:
    """Keeps each policy's engine on the newest published weights."""

    def __init__(self, cfg: ClusterConfig, engines: dict[str, Engine], node_id: str, *,
                 check_every_s: float = 5.0) -> None:
        from astraflow.delta import WeightStore, WeightSubscriber
        from astraflow.objstore.regional import open_reader

        self.cfg = cfg
        self.engines = engines
        self.node_id = node_id
        self.check_every_s = check_every_s
        # One reader for every policy: the regional replica's when the cluster config names one.
        self.objects = open_reader(cfg)
        # Registered under the node id, so the weight store's GC keeps the chain this node is on.
        self.subscribers = {p: WeightSubscriber(cfg, p, node_id, store=WeightStore(self.objects, cfg.run, p),
                                                record_every_s=RECORD_EVERY_S)
                            for p in engines}
        self.refreshes = 0
        self.refresh_s = 0.0
        """Seconds the last refresh took (pull + decode + swap)."""
        self.paused_s = 0.0
        """Seconds the engine was paused by the last in-place patch (the writes only)."""
        self._full_loads_only: set[str] = set()  # policies whose engine cannot take deltas in place
        self.unreachable = 0
        """Versions skipped because no path to them avoids the refused objects."""
        self._unreachable: dict[str, int] = {}  # policy -> the last version skipped (logged once)
        self.serving = HandoffLatency()
        """Announcement sent -> new weights serving, per ``<weights topic>:serving``."""
        self._loaded: set[str] = set()
        self._served_listeners: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def on_served(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the refresh thread) each time an engine starts serving a new version,
        so that work waiting for a version starts then instead of at its next poll."""
        self._served_listeners.append(listener)

    def _now_serving(self, serving: Callable[[], None] | None) -> None:
        if serving is not None:
            serving()
        for listener in self._served_listeners:
            try:
                listener()
            except Exception:  # e.g. the node's loop closed while it stops: the refresh stands
                log.debug("a served-version listener failed", exc_info=True)

    @property
    def versions(self) -> dict[str, int]:
        return {p: e.weight_version for p, e in self.engines.items()}

    @property
    def counters(self) -> dict[str, int]:
        """``weights.refused.<reason>`` (objects refused, see
        :func:`~astraflow.delta.subscriber.refusal_reason`) and ``weights.unreachable``, cumulative."""
        out: dict[str, int] = {}
        for sub in self.subscribers.values():
            for reason in list(sub.refused.values()):
                out[f"weights.refused.{reason}"] = out.get(f"weights.refused.{reason}", 0) + 1
        if self.unreachable:
            out["weights.unreachable"] = self.unreachable
        return out

    def region_record(self) -> dict | None:
        """The regional reader's figures for the metrics record (bytes from the replica and the
        origin, misses, fallbacks, the replication lag waited out since the last record), or None
        when the node reads the origin only."""
        from astraflow.objstore.regional import RegionalStore

        return self.objects.stats.record() if isinstance(self.objects, RegionalStore) else None

    def refresh(self, policy: str, announced: int | None = None,
                serving: Callable[[], None] | None = None) -> bool:
        """Load the latest version of ``policy`` if it is newer than the engine's; True if loaded.
        False also when the latest version cannot be reached (see the module docstring).

        ``announced``: the version an announcement named, taken as the latest without listing the
        bucket (a newer one has its own announcement, and the periodic check lists). ``serving`` is
        called the moment the engine serves the new version, before the bookkeeping after it (the
        subscriber's record in the bucket, the patch's verification)."""
        from astraflow.delta import NoPathError

        sub, engine = self.subscribers[policy], self.engines[policy]
        latest = sub.latest_version() if announced is None else announced
        # The first load always happens: the engine starts from the seeded model, whose "version 0"
        # need not be the published v0 (e.g. after an SFT warm start).
        if latest is None or (policy in self._loaded and latest <= engine.weight_version):
            return False
        t0 = time.perf_counter()
        if policy in self._loaded and self._patch(policy, latest, serving):
            self.refresh_s = time.perf_counter() - t0
            self.refreshes += 1
            log.info("node %s: %s -> v%d in %.2fs (patched in place, paused %.3fs)", self.node_id, policy, latest,
                     self.refresh_s, self.paused_s)
            return True
        try:
            fetched = self._fetch_in_full(policy, latest)
        except NoPathError as exc:  # e.g. only through a refused object: wait for a newer version
            if self._unreachable.get(policy) != latest:
                self._unreachable[policy] = latest
                self.unreachable += 1
                serving = f"v{engine.weight_version}" if policy in self._loaded else "nothing yet"
                log.warning("node %s: %s v%d skipped (%s); serving %s", self.node_id, policy, latest, exc, serving)
            return False
        if fetched is not None:
            engine.update_weights(fetched)
        self._now_serving(serving)
        if fetched is not None:
            sub.heartbeat()
        self.refresh_s = time.perf_counter() - t0
        self.refreshes += 1
        self._loaded.add(policy)
        log.info("node %s: %s -> v%d in %.2fs", self.node_id, policy, latest, self.refresh_s)
        return True

    def _fetch_in_full(self, policy: str, latest: int) -> FullState | None:
        """The whole of ``latest`` for the engine to load. An engine that accepts
        :class:`PublishedVersion` (a vLLM server's workers) fetches it itself: it is brought to
        ``latest`` here and None is returned. For any other the subscriber's own copy is pulled, to be
        loaded but not kept (its record is written after serving). Raises
        :class:`~astraflow.delta.NoPathError` when ``latest`` cannot be reached."""
        engine = self.engines[policy]
        if PublishedVersion in engine.accepted_updates:
            engine.update_weights(PublishedVersion(self.cfg, policy, latest, self.node_id))
            return None
        if FullState not in engine.accepted_updates:
            raise UpdateRefusedError(engine, FullState)
        state, _, _ = self.subscribers[policy].pull(latest, register=False)
        return FullState(state, latest)

    def _patch(self, policy: str, latest: int, serving: Callable[[], None] | None) -> bool:
        """Bring an engine that accepts :class:`InPlacePatch` to ``latest`` by patching its tensors
        in place (:mod:`astraflow.delta.patch`): fetch and decode here, pause the engine only for the
        writes, verify after. False when the engine cannot be patched or the way there needs a full load."""
        from astraflow.delta import BaseMismatchError

        sub, engine = self.subscribers[policy], self.engines[policy]
        if InPlacePatch not in engine.accepted_updates or policy in self._full_loads_only:
            return False
        live = engine.state_dict()  # the tensors it serves from (the InPlacePatch contract)
        if not live:
            return False
        try:
            patch = sub.prepare_patch(live, latest)
        except BaseMismatchError as exc:  # e.g. an fp32 model fed bf16 weights: full loads from now on
            self._full_loads_only.add(policy)
            log.info("node %s: %s refreshes by full load (the engine's tensors cannot take the deltas: %s)",
                     self.node_id, policy, exc)
            return False
        if patch is None:
            return False
        t0 = time.perf_counter()
        engine.update_weights(InPlacePatch(patch.write, patch.version))
        self.paused_s = time.perf_counter() - t0
        self._now_serving(serving)
        sub.patched(patch)
        mismatched = patch.verify(live)
        if mismatched:  # the engine's bits were not the version we held: reload from an anchor
            log.error("node %s: %s v%d tensors %s differ from the trainer's after patching; reloading in full",
                      self.node_id, policy, patch.version, mismatched[:5])
            sub.version = None
            return False
        return True

    def catch_up(self, timeout_s: float = 600.0, stop_event: threading.Event | None = None) -> dict[str, int]:
        """Block until every policy has a published version and its engine serves the latest one."""
        from astraflow.objstore import ObjectStoreUnavailableError
        from astraflow.outage import OutageReport

        deadline = time.monotonic() + timeout_s
        waiting = set(self.engines)
        s3 = OutageReport(f"node {self.node_id}: S3 endpoint", str(self.cfg.s3.endpoint), log)
        while waiting:
            try:
                for policy in sorted(waiting):
                    self.refresh(policy)
                    if policy in self._loaded:
                        waiting.discard(policy)
                s3.ok()
            except ObjectStoreUnavailableError as exc:
                s3.failed(exc)  # the bucket may be starting: wait for it within timeout_s
            if not waiting:
                break
            if stop_event is not None and stop_event.is_set():
                raise InterruptedError("stopped while waiting for the first weights")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.node_id}: no weights published for {sorted(waiting)} "
                                   f"within {timeout_s:g} s (is the trainer running?)")
            time.sleep(0.5)
        return self.versions

    # -- following ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name=f"weights-{self.node_id}", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Re-raise an error of the follower thread in the caller."""
        if self._error is not None:
            raise RuntimeError(f"weight follower of node {self.node_id} failed: {self._error}") from self._error

    def _follow(self) -> None:
        """The follower thread: poll the announcements, schedule the periodic checks, and serve what
        is due, one refresh at a time, until stopped (errors other than outages: :meth:`check`)."""
        from astraflow.log import BrokerUnavailableError, Topics
        from astraflow.objstore import ObjectStoreUnavailableError
        from astraflow.objstore.regional import ReplicaLagError
        from astraflow.outage import OutageReport

        topics = Topics(self.cfg.run)
        by_topic = {topics.weights(p): p for p in self.engines}
        # The broker and the bucket may go away and come back (a restart): wait for them, one log
        # line per backoff step, instead of failing the node. Anything else is a bug or bad data.
        s3 = OutageReport(f"node {self.node_id}: S3 endpoint", str(self.cfg.s3.endpoint), log)
        broker = OutageReport(f"node {self.node_id}: Kafka broker", str(self.cfg.kafka.bootstrap), log)
        consumer = None
        # Refreshes run on a worker thread while this one keeps polling: kafka-python (3.0) drops a
        # group join that completes while nobody polls and starts it over, so refreshes slower than
        # a join (a remote region: seconds of round trips) kept the member re-joining, and each
        # re-join skips to the latest offset: announcements went unseen, only the periodic check
        # refreshed the node.
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"refresh-{self.node_id}")
        pending = _Pending(last_check=time.monotonic())
        try:
            while not self._stop.is_set():
                try:
                    if consumer is None:
                        consumer = self._subscribe(list(by_topic))
                        broker.ok()
                    self._poll_announcements(consumer, by_topic, pending)
                    self._schedule_check(pending, s3.down)
                    self._serve(pool, pending, s3)
                except ReplicaLagError as exc:  # the origin answers: not an outage; the next check retries
                    log.warning("node %s: %s; serving %s meanwhile", self.node_id, exc, self.versions)
                except ObjectStoreUnavailableError as exc:
                    self._stop.wait(s3.failed(exc))
                except BrokerUnavailableError as exc:
                    self._stop.wait(broker.failed(exc))
        except BaseException as exc:
            if not self._stop.is_set():
                log.exception("weight follower failed")
                self._error = exc
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            if consumer is not None:
                try:
                    consumer.close()
                except Exception:
                    log.debug("closing the announcement consumer failed", exc_info=True)

    def _subscribe(self, topics: list[str]) -> LogConsumer:
        """A consumer of the weights ``topics`` from their latest offsets, in a group of its own:
        every node must see every announcement (no load balancing here)."""
        from astraflow.log import LogConsumer
        from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA

        group = f"{self.cfg.run}.raas-weights.{self.node_id}.{uuid.uuid4().hex[:8]}"
        return LogConsumer(self.cfg, topics, group, auto_offset_reset="latest",
                           expected_schemas=dict.fromkeys(topics, WEIGHT_ANNOUNCEMENT_SCHEMA))

    def _poll_announcements(self, consumer: LogConsumer, by_topic: dict[str, str], pending: _Pending) -> None:
        """Read the announcements that arrived (briefly while a refresh runs, so that its end is seen
        soon): each makes its policy due, at the newest version named, and prefetches its manifest."""
        for msg in consumer.poll(timeout_s=0.5 if pending.running is None else 0.1):
            if msg.topic not in by_topic:
                continue
            policy = by_topic[msg.topic]
            # The consumer accepts only announcements, parsed at decode (one that does not parse is
            # dead-lettered): the isinstance only narrows the type.
            announcement = msg.record if isinstance(msg.record, WeightAnnouncement) else None
            pending.announce(policy, msg.topic, msg.timestamp_ms, announcement)
            if announcement is not None:
                self._remember_manifest(policy, announcement)

    def _schedule_check(self, pending: _Pending, s3_down: bool) -> None:
        """Make every policy due (its latest version listed in the bucket) every ``check_every_s``, or
        at once while the bucket is down: covers announcements missed or published before joining."""
        if s3_down or time.monotonic() - pending.last_check > self.check_every_s:
            pending.due.update(self.engines)
            pending.last_check = time.monotonic()

    def _serve(self, pool: ThreadPoolExecutor, pending: _Pending, s3: OutageReport) -> None:
        """Collect the refresh that finished (its store errors are raised here, as if from this
        thread) and hand what is due to the next one."""
        if pending.running is not None and pending.running.done():
            finished, pending.running = pending.running, None
            finished.result()
            s3.ok()
        if pending.running is None and pending.due:
            pending.running = pool.submit(self._refresh_all, sorted(pending.due), pending.announced)
            pending.due, pending.announced = set(), {}

    def _remember_manifest(self, policy: str, announcement: WeightAnnouncement) -> None:
        """Give the policy's store the manifest an announcement carries, so that the refresh plans
        without reading it from the bucket (without one, or with one not its own, it is read there)."""
        from astraflow.delta import carried_manifest

        manifest = carried_manifest(announcement)
        if manifest is not None and manifest.policy == policy:
            self.subscribers[policy].store.remember(manifest)
        elif announcement.manifest_body is not None:
            log.warning("node %s: the %s announcement of v%d carries a manifest that is not its own; "
                        "reading it from the bucket", self.node_id, policy, announcement.version)

    def _refresh_all(self, policies: list[str], announced: dict[str, tuple[str, int | None, int | None]]) -> None:
        """Refresh ``policies``, an announced one to the version its announcement named."""
        for policy in policies:
            if policy in announced:
                self._refresh_announced(policy, *announced[policy])
            else:
                self.refresh(policy)

    def _refresh_announced(self, policy: str, topic: str, timestamp_ms: int | None, version: int | None) -> None:
        """Refresh ``policy`` to the announced ``version``; the announcement counts as served the moment
        the engine serves it (the follower thread would see that only after its next poll, up to
        0.1 s later, and the subscriber's record is written after)."""
        served: list[bool] = []

        def observe() -> None:
            served.append(True)
            self.serving.observe(f"{topic}:serving", timestamp_ms)

        self.refresh(policy, version, serving=observe)
        # Nothing loaded because the engine got there before (a periodic check): served since then.
        if not served and (version is None or self.engines[policy].weight_version >= version):
            observe()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for sub in self.subscribers.values():
            try:
                sub.close()
            except Exception:
                log.debug("unregistering subscriber %s failed", sub.subscriber_id, exc_info=True)


@dataclass
class _Pending:
    """What the follower thread has seen and not yet served, and the refresh in flight."""

    last_check: float
    """``time.monotonic()`` of the last periodic check."""
    due: set[str] = field(default_factory=set)
    """Policies to refresh next."""
    announced: dict[str, tuple[str, int | None, int | None]] = field(default_factory=dict)
    """policy -> (its weights topic, timestamp of its first unserved announcement, newest version named)."""
    running: Future | None = None
    """The refresh in flight (one at a time)."""

    def announce(self, policy: str, topic: str, timestamp_ms: int | None,
                 announcement: WeightAnnouncement | None) -> None:
        """Make ``policy`` due at the newest version announced so far (its first announcement's time kept)."""
        self.due.add(policy)
        topic, first_ms, newest = self.announced.get(policy, (topic, timestamp_ms, None))
        self.announced[policy] = (topic, first_ms, _newest(newest, announcement))


def _newest(known: int | None, announcement: WeightAnnouncement | None) -> int | None:
    """The newer of ``known`` and the version an announcement names (None when the record is not a
    well-formed announcement: the refresh then lists the bucket)."""
    if announcement is None:
        return known
    return announcement.version if known is None else max(known, announcement.version)
