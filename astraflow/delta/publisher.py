"""Trainer side: publish each new version off the training loop's critical path.

``publish(state_dict, version)`` snapshots the weights where they are, CPU or GPU (the only work on
the caller's thread), and queues them; ``assume_published`` names a version already in the store as the base of
the next delta. A background thread encodes the delta from the previous version, uploads
the anchor (every ``anchor_every`` versions, and always first) and/or the delta side by side, writes the
manifest last (conditional put), then announces the version on ``<run>.weights.<policy>``. The
caller blocks only when more than ``max_lag_versions`` versions wait to be uploaded. Memory: the
previous snapshot plus up to ``max_lag_versions + 1`` queued ones.

A failure in the background thread stops publishing (a later delta would have a missing base)
and is raised, as :class:`PublisherError`, from the next ``publish``/``flush``/``close``. A fresh
publisher starts with an anchor. An unreachable bucket (a restarting S3 server) is not a failure: each
upload waits for it (:func:`~astraflow.outage.wait_out_outage`, one log line per backoff step, at most
``outage_deadline_s``) and the version is published when it returns; versions stay in order (one
thread), and the caller blocks only once ``max_lag_versions`` versions are queued behind it.

A rank group publishes in parts (``part``, :mod:`astraflow.delta.parts`): every rank's publisher
encodes and uploads the delta (and anchor) of its own rows against its previous rows, side by side with
the others, then a small part record (``part-<i>-of-<n>.json``: its objects, its rows' CRCs); rank 0's
waits until every part's record of the group is in the bucket, writes the manifest listing the parts
(the whole tensors' CRCs combined from the parts'), announces it and runs the GC. No rank gathers the
weights. One rank is the one-part case of the same format.

Garbage collection during the run (``gc_every``): every ``gc_every`` versions published, the publisher
runs :meth:`WeightStore.gc` (the same call as ``astraflow weights gc``, the same retention rule:
:mod:`astraflow.delta.retention`) on a thread of its own, so neither the training loop nor the next
version's upload waits for it. At most one GC waits behind the running one (a later trigger finds it
queued and leaves it to see the newer versions). A failed GC is logged and counted, never raised: the
next one deletes what it left. :attr:`gc_totals` counts what was deleted.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Self

import torch
from pydantic import BaseModel, ConfigDict

from astraflow.background_calls import BackgroundCalls
from astraflow.delta.codec import encode
from astraflow.delta.errors import PublisherError, VersionExistsError
from astraflow.delta.format import read_header
from astraflow.delta.manifest import Manifest, Part, state_digest
from astraflow.delta.parts import PartOf, Rows, combined_crcs
from astraflow.delta.retention import RetentionPolicy
from astraflow.delta.store import WeightStore, state_crcs
from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA
from astraflow.objstore.errors import ObjectNotFoundError
from astraflow.outage import OUTAGE_DEADLINE_S, OutageReport, wait_out_outage
from astraflow.records.control import WeightAnnouncement

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

_STOP = object()
ANNOUNCED_MANIFEST_MAX_TENSORS = 2048
"""Announcements carry the manifest up to this many tensors (~120 KB of JSON; a version in N parts
counts each tensor N times: each part lists its rows), so that they stay small inline records; a
larger model's subscribers read the manifest from the bucket."""
STAGES_KEPT = 64
"""Versions whose stage timings a publisher keeps (:attr:`WeightPublisher.stage_s`)."""
MANIFESTS_KEPT = 256
"""Newest published manifests kept in memory: a 10,000-step run kept every one (~10 KB each at the demo's
model), and its trainer's RSS grew by ~95 MB (benchmarks/long_run.py, 27 Nov); the publisher's store
cached the same manifests, bounded since by :data:`astraflow.delta.store.MANIFESTS_CACHED`."""
PART_WAIT_S = 600.0
"""How long the manifest's writer waits for the other parts of a version (a dead rank stops the group sooner)."""
GC_CLOSE_WAIT_S = 60.0
"""``close`` waits this long for a GC still running (a GC cut short deletes manifests first: harmless)."""
log = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(
        self,
        cfg: ClusterConfig,
        policy: str,
        *,
        anchor_every: int = 10,
        max_lag_versions: int = 2,
        announce: bool = True,
        store: WeightStore | None = None,
        producer_id: str | None = None,
        outage_deadline_s: float = OUTAGE_DEADLINE_S,
        gc_every: int = 0,
        retention: RetentionPolicy | None = None,
        part: PartOf | None = None,
        part_wait_s: float = PART_WAIT_S,
    ) -> None:
        """``part``: this publisher writes one part of each version (a rank of a group: its own rows,
        given to :meth:`publish`); the one with ``part.writes_manifest`` waits for the others' part
        records, writes the manifest, announces and runs the GC (``announce`` and ``gc_every`` are
        ignored on the others). ``part_wait_s``: how long it waits for them before it fails."""
        if part is not None and not part.writes_manifest:
            announce, gc_every = False, 0
        self.part = part
        self.part_wait_s = part_wait_s
        if anchor_every < 1 or max_lag_versions < 0 or gc_every < 0:
            raise ValueError("anchor_every must be >= 1, max_lag_versions and gc_every >= 0")
        self.cfg = cfg
        self.policy = policy
        self.anchor_every = anchor_every
        self.store = store or WeightStore.from_config(cfg, policy)
        self.outage_deadline_s = outage_deadline_s
        self._s3 = OutageReport(f"weight publisher {policy}: S3 endpoint",
                                str(getattr(self.store.objects, "endpoint", "?")), log)
        self.published: deque[Manifest] = deque(maxlen=MANIFESTS_KEPT)
        """The newest published manifests (:data:`MANIFESTS_KEPT`), oldest first; :meth:`published_after`
        hands them to a reader that keeps up."""
        self.published_total = 0
        """Versions this publisher has published (announced) in all."""
        self._published_lock = threading.Lock()
        self.stage_s: dict[int, dict[str, float]] = {}
        """Version -> seconds of its stages on the publisher's thread: ``encode`` (CRCs + delta),
        ``upload`` (this part's objects and record), ``parts_wait`` (the manifest's writer waiting for the
        other parts), ``announce`` (manifest + announcement); the newest :data:`STAGES_KEPT` versions."""
        self.announced_at: dict[int, float] = {}
        """Version -> Unix time its announcement was acknowledged (or its manifest written, without
        announcements); the caller pops what it has read."""
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_lag_versions))
        self._spare: dict[str, torch.Tensor] = {}
        """The copies the publisher made of a retired snapshot (no longer any delta's base, its encode and
        uploads done), reused by the next :meth:`publish`: copying 3 GB into fresh memory costs its page
        faults every version (1.7-2.1 s wall against 0.55-0.67 s into reused pages at 1.5B, load 9). At most
        one snapshot's worth is kept; tensors the caller handed over (``owned``) are never reused."""
        self._spare_lock = threading.Lock()
        self._error: BaseException | None = None
        self._last_version: int | None = None
        self._base_version: int | None = None
        """The version given to ``assume_published`` (queued like a publish, not uploaded)."""
        self._closed = False
        self._producer = None
        self._topic = None
        if announce:
            from astraflow.log import LogProducer, Topics, ensure_topics

            self._topic = Topics(cfg.run).weights(policy)
            ensure_topics(cfg, {self._topic: 1})
            # One record per version, awaited before the next: nothing to batch, so no linger.
            self._producer = LogProducer(cfg, producer_id or f"weights-publisher-{policy}", linger_ms=0)
        self._side = BackgroundCalls(f"weight-publisher-{policy}-io")
        """The bucket calls that overlap the publisher thread's own (its HEAD, an anchor's upload)."""
        self.gc_every = gc_every
        """Run the weight GC every this many published versions (0: never)."""
        self.retention = retention or RetentionPolicy()
        self.gc_totals = {"runs": 0, "failed": 0, "versions": 0, "orphans": 0, "subscribers": 0}
        """GCs run and failed; published versions, unpublished leftovers and expired subscriber records deleted."""
        # Its own store (one manifest cache per thread), over the same bucket client.
        self._gc_store = WeightStore(self.store.objects, self.store.layout.run, policy)
        self._gc_calls = BackgroundCalls(f"weight-publisher-{policy}-gc")
        self._gc_last: Future | None = None
        self._thread = threading.Thread(target=self._run, name=f"weight-publisher-{policy}", daemon=True)
        self._thread.start()

    # -- caller side -----------------------------------------------------------------------------
    def publish(self, state_dict: dict[str, torch.Tensor], version: int, *, owned: bool = False,
                batch_id: str | None = None, rows: Rows | None = None,
                shapes: dict[str, list[int]] | None = None) -> None:
        """Snapshot ``state_dict`` as ``version`` and queue it (blocks only when the queue is full).
        ``owned``: the caller hands the tensors over (nothing writes them after this call, e.g. the
        fresh copies a trainer backend's ``state_dict`` returns), so host tensors are not copied again.
        ``batch_id``: the last batch trained into these weights, carried by the announcement
        (:attr:`WeightAnnouncement.batch_id`). A part publisher (``part``) is given its rows of each
        tensor as ``state_dict`` (e.g. its FSDP shards), their spans ``rows`` and the whole ``shapes``."""
        if (self.part is None) != (rows is None) or (rows is None) != (shapes is None):
            raise ValueError("a part publisher takes rows and shapes with each state, a whole one neither")
        self._raise_if_failed()
        if self._closed:
            raise PublisherError("publisher is closed")
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"versions must increase: {version} after {self._last_version}")
        # The snapshot stays where the weights are: a CUDA trainer's version is encoded on its GPU
        # (codec._diff_device, device_crc), and only the packed planes cross to the host.
        snapshot, copied = {}, {}
        spare = self._take_spare()
        for name, t in state_dict.items():
            t = t.detach()
            if owned and t.is_contiguous():
                snapshot[name] = t
                continue
            buf = spare.get(name)
            if buf is not None and (buf.shape, buf.dtype, buf.device) == (t.shape, t.dtype, t.device):
                buf.copy_(t)  # into the pages of a retired snapshot: no fresh memory to fault in
            else:
                buf = t.clone(memory_format=torch.contiguous_format)
            snapshot[name] = copied[name] = buf
        while True:  # a bounded wait, so a failure of the thread is noticed while blocked
            try:
                self._queue.put((version, snapshot, batch_id, rows, shapes, copied), timeout=0.5)
                break
            except queue.Full:
                self._raise_if_failed()
        self._last_version = version

    def _take_spare(self) -> dict[str, torch.Tensor]:
        with self._spare_lock:
            spare, self._spare = self._spare, {}
        return spare

    def published_after(self, seen: int) -> tuple[list[Manifest], int]:
        """The manifests published after the first ``seen`` (those still kept), and how many there are in all."""
        with self._published_lock:
            fresh = min(self.published_total - seen, len(self.published))
            return list(self.published)[len(self.published) - fresh:], self.published_total

    def assume_published(self, state_dict: dict[str, torch.Tensor], version: int, *, rows: Rows | None = None,
                         shapes: dict[str, list[int]] | None = None) -> None:
        """Take ``version``, already in the store with exactly these bits (e.g. the version a trainer
        bootstrapped from, as pulled), as the base of the next publish: ``version + 1`` is then a
        delta instead of the anchor a fresh publisher starts with. Call before the first publish."""
        if self._last_version is not None:
            raise ValueError("assume_published must come before the first publish")
        self._base_version = version  # before queueing: the thread must never upload it
        self.publish(state_dict, version, rows=rows, shapes=shapes)

    def flush(self) -> None:
        """Block until every queued version is published (or raise the thread's error)."""
        while self._queue.unfinished_tasks and self._thread.is_alive():
            time.sleep(0.01)
        self._raise_if_failed()

    def close(self) -> None:
        """Drain the queue, stop the thread, close the producer; raise a background error if any."""
        if not self._closed:
            self._closed = True
            if self._thread.is_alive():
                self._queue.put(_STOP)
            self._thread.join()
            self._side.close()
            if self._gc_last is not None:
                wait_futures([self._gc_last], timeout=GC_CLOSE_WAIT_S)
            self._gc_calls.close()
            if self._producer is not None:
                self._producer.close()
        self._raise_if_failed()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PublisherError(f"weight publishing of {self.policy} failed: {self._error}") from self._error

    # -- background thread -----------------------------------------------------------------------
    def _run(self) -> None:
        # (version, its state, its tensors' CRC-32C once computed): the next delta's base
        prev: tuple[int, dict[str, torch.Tensor], dict[str, int] | None] | None = None
        prev_copied: dict[str, torch.Tensor] = {}
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                version, state, batch_id, rows, shapes, copied = item
                crcs = None
                if version != self._base_version:
                    manifest, crcs = self._publish_one(version, state, prev, batch_id, rows, shapes)
                    if manifest is not None:
                        with self._published_lock:
                            self.published.append(manifest)
                            self.published_total += 1
                    if self.gc_every and self.published_total % self.gc_every == 0:
                        self._start_gc()
                prev = (version, state, crcs)
                retired, prev_copied = prev_copied, copied
                del state, copied, item
                if retired:  # the old base: nothing reads it any more (its encode and uploads are done)
                    with self._spare_lock:
                        self._spare = retired
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._error = exc
                self._drain()
                return
            finally:
                self._queue.task_done()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
                self._queue.task_done()
            except queue.Empty:
                return

    def _start_gc(self) -> None:
        last = self._gc_last
        if last is not None and not last.running() and not last.done():
            return  # one is queued already: it runs after the version just published
        self._gc_last = self._gc_calls.submit(self._gc_once)

    def _gc_once(self) -> None:
        """One :meth:`WeightStore.gc` (on the GC thread); its outcome is logged and counted."""
        t0 = time.perf_counter()
        try:
            plan = self._gc_store.gc(self.retention)
        except Exception as exc:  # noqa: BLE001 - housekeeping: the next GC tries again
            self.gc_totals["failed"] += 1
            log.warning("weights gc %s failed (the next one tries again): %s", self.policy, exc)
            return
        totals = self.gc_totals
        totals["runs"] += 1
        totals["versions"] += len(plan.delete)
        totals["orphans"] += len(plan.orphans)
        totals["subscribers"] += len(plan.expired)
        log.info("weights gc %s: deleted %d versions%s, %d unpublished leftovers, %d expired subscriber records; "
                 "kept %d (latest v%s, %d live subscribers) in %.2fs", self.policy, len(plan.delete),
                 f" (v{plan.delete[0]}..v{plan.delete[-1]})" if plan.delete else "", len(plan.orphans),
                 len(plan.expired), len(plan.keep), plan.latest, len(plan.live), time.perf_counter() - t0)

    def _s3_call(self, fn):
        """One idempotent bucket call, waiting out an unreachable bucket (other errors raise)."""
        return wait_out_outage(fn, self._s3, deadline_s=self.outage_deadline_s)

    def _publish_one(self, version: int, state: dict, prev: tuple[int, dict, dict | None] | None,
                     batch_id: str | None, rows: Rows | None,
                     shapes: dict[str, list[int]] | None) -> tuple[Manifest | None, dict[str, int]]:
        """Upload this publisher's part of ``version`` (the whole state when it is the only part); the
        manifest's writer then writes the manifest and announces it (returned; None on the others),
        with the state's CRC-32C (the next delta's base CRCs)."""
        # Refuse before uploading: objects of a published version must never be replaced. (Two
        # live publishers of one policy racing on a version remain unsupported.) The HEAD runs beside
        # the CRCs and the encode, which upload nothing, and is awaited before the first upload.
        t0 = time.perf_counter()
        stages = self.stage_s.setdefault(version, {})
        while len(self.stage_s) > STAGES_KEPT:
            self.stage_s.pop(next(iter(self.stage_s)))
        manifest_key = self.store.layout.manifest_key(self.policy, version)
        published = self._side.submit(lambda: self._s3_call(lambda: self.store.objects.exists(manifest_key)))
        has_base = prev is not None and prev[0] == version - 1
        if has_base:  # the state's CRCs come out of the encode's own pass over it
            computed: dict[str, int] = {}
            blob = encode(prev[1], state, base_version=prev[0], target_version=version, crcs_old=prev[2],
                          crcs_out=computed)
            crcs = {name: computed[name] for name in state}
        else:
            blob, crcs = None, state_crcs(state)
        if published.result():
            raise VersionExistsError(f"{self.policy} v{version} is already published")
        index, count = (0, 1) if self.part is None else (self.part.index, self.part.parts)
        t1 = time.perf_counter()
        stages["encode"] = t1 - t0
        # An anchor falls due every ``anchor_every`` versions, and when there is no delta (the first
        # version, or versions skipped); it uploads beside the delta, so a due anchor adds no time of its own.
        # Every part decides alike: each publishes the same versions.
        anchor_due = blob is None or version % self.anchor_every == 0
        anchor_upload = (self._side.submit(lambda: self._s3_call(
            lambda: self.store.put_anchor(version, state, index, count))) if anchor_due else None)
        header = read_header(blob) if blob is not None else None
        delta = self._s3_call(lambda: self.store.put_delta(version, blob, index, count)) if blob is not None else None
        anchor = anchor_upload.result() if anchor_upload is not None else None
        stages["upload"] = time.perf_counter() - t1
        if self.part is None:
            shapes = {name: list(t.shape) for name, t in state.items()}
            part, tensors = Part(anchor=anchor, delta=delta), crcs
            changed = header.changed if header else None
            params = sum(t.numel() for t in state.values())
            full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        else:
            record = PartRecord(group=self.part.group, part=Part(rows=rows, anchor=anchor, delta=delta, tensors=crcs),
                                nbytes={name: t.numel() * t.element_size() for name, t in state.items()},
                                changed=header.changed if header else None)
            record_key = self.store.layout.part_record_key(self.policy, version, index, count)
            self._s3_call(lambda: self.store.objects.put_json(record_key, record.model_dump(mode="json")))
            stages["upload"] = time.perf_counter() - t1
            if not self.part.writes_manifest:
                return None, crcs
            t2 = time.perf_counter()
            records = self._part_records(version)
            stages["parts_wait"] = time.perf_counter() - t2
            part = None
            tensors = combined_crcs([(r.part.rows, r.part.tensors, r.nbytes) for r in records])
            changed = None if any(r.changed is None for r in records) else sum(r.changed for r in records)
            params = sum(math.prod(shape) for shape in shapes.values())
            full_bytes = sum(n for r in records for n in r.nbytes.values())
        manifest = Manifest(
            policy=self.policy,
            version=version,
            kind="anchor" if anchor is not None else "delta",
            base=version - 1 if delta is not None else None,
            parts=[part] if part is not None else [r.part for r in records],
            shapes=shapes,
            params=params,
            full_bytes=full_bytes,
            changed=changed,
            sparsity=None if changed is None else (1.0 - changed / params if params else 1.0),
            tensors=tensors,
            state_digest=state_digest(tensors),
        )
        # A retry after a lost response finds its own manifest: republishing it unchanged is a no-op.
        t3 = time.perf_counter()
        self._s3_call(lambda: self.store.publish(manifest))
        if self._producer is not None:
            announcement = WeightAnnouncement(
                version=version, policy=self.policy, kind=manifest.kind,
                manifest=self.store.layout.manifest_key(self.policy, version), bytes=manifest.bytes,
                checksum=manifest.state_digest, batch_id=batch_id,
                # The manifest itself (one CRC per tensor: ~20 KB at 1.5B), so that a subscriber following
                # the topic plans without reading it back from the bucket (WeightStore.remember).
                manifest_body=(manifest.model_dump(mode="json")
                               if len(manifest.tensors) * len(manifest.parts) <= ANNOUNCED_MANIFEST_MAX_TENSORS
                               else None),
            )
            self._producer.send_json(
                self._topic, str(version), announcement.model_dump(mode="json", exclude_none=True),
                schema_name=WEIGHT_ANNOUNCEMENT_SCHEMA[0], schema_version=WEIGHT_ANNOUNCEMENT_SCHEMA[1],
                policy=self.policy,
            ).result(timeout=30)
        self.announced_at[version] = time.time()
        stages["announce"] = time.perf_counter() - t3
        return manifest, crcs

    def _part_records(self, version: int) -> list[PartRecord]:
        """Every part's record of ``version`` from this publishing group, once all are in the bucket (the
        group's barrier: the parts upload side by side, the manifest waits for the last)."""
        layout, objects = self.store.layout, self.store.objects
        found: dict[int, PartRecord] = {}
        deadline, pause = time.monotonic() + self.part_wait_s, 0.005
        while True:
            for i in range(self.part.parts):
                if i in found:
                    continue
                key = layout.part_record_key(self.policy, version, i, self.part.parts)
                try:
                    record = PartRecord.model_validate(self._s3_call(lambda key=key: objects.get_json(key)))
                except ObjectNotFoundError:
                    continue
                if record.group == self.part.group:  # another group's: a dead life's, overwritten soon
                    found[i] = record
            if len(found) == self.part.parts:
                return [found[i] for i in range(self.part.parts)]
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.part.parts)) - set(found))
                raise PublisherError(f"{self.policy} v{version}: parts {missing} of {self.part.parts} were not "
                                     f"uploaded within {self.part_wait_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


class PartRecord(BaseModel):
    """What a part publisher uploaded for one version (``part-<i>-of-<n>.json``), read by the manifest's writer."""

    model_config = ConfigDict(extra="forbid")
    group: str
    """The publishing group (:attr:`PartOf.group`)."""
    part: Part
    """The part as the manifest lists it."""
    nbytes: dict[str, int]
    """Bytes of each of its row ranges (to combine the CRCs)."""
    changed: int | None
    """Elements of its rows changed since the base (None: no delta)."""
