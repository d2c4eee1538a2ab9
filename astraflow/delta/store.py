"""``WeightStore``: one policy's versions in the bucket — anchors, deltas, manifests, subscribers.

Layout (``RunLayout``)::

    <run>/weights/<policy>/v00000010/anchor.safetensors   full checkpoint, every K versions
    <run>/weights/<policy>/v00000011/delta.zst            codec delta v10 -> v11
    <run>/weights/<policy>/v00000011/manifest.json        written last, If-None-Match: *
    <run>/weights/<policy>/v00000012/delta.part-0-of-2.zst  part 0 of 2 (a rank group's rows; anchors alike)
    <run>/weights/<policy>/v00000012/part-0-of-2.json     what rank 0 uploaded, for the manifest's writer
    <run>/weights/<policy>/subscribers/<id>.json          {id, version, heartbeat}

Manifests are immutable once published, so they are cached. Retention is described in
:mod:`astraflow.delta.retention`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Collection, MutableMapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from astraflow.background_calls import BackgroundCalls
from astraflow.delta.bits import dtype_name, tensor_checksum
from astraflow.delta.errors import DeltaCorruptError, NoPathError, VersionExistsError, VersionNotFoundError
from astraflow.delta.manifest import Manifest, ObjectInfo
from astraflow.delta.parts import Rows, row_view
from astraflow.delta.planner import Plan, plan_path
from astraflow.delta.retention import GcPlan, RetentionPolicy, SubscriberRecord, plan_gc
from astraflow.objstore import ObjectStore, RunLayout, parse_version, publish_manifest
from astraflow.objstore.errors import ObjectExistsError, ObjectNotFoundError
from astraflow.objstore.layout import NAME_RE

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

SUBSCRIBERS_DIR = "subscribers/"
NEAR_VERSIONS = 8
"""How far ahead a plan reads manifests one by one instead of listing the bucket."""
MANIFESTS_CACHED = 256
"""Newest manifests a store keeps in memory (older ones are read from the bucket again when asked for):
a publisher's store cached every version it wrote (~10 KB each at the demo's model), and a trainer's RSS
grew ~10 MB per 1,000 steps (benchmarks/long_run.py, 28 Nov)."""


class WeightStore:
    def __init__(self, objects: ObjectStore, run: str, policy: str) -> None:
        self.objects = objects
        self.layout = RunLayout(run)
        self.policy = policy
        self.prefix = self.layout.weights_prefix(policy)
        self._manifests: dict[int, Manifest] = {}
        self._prefetched: tuple[int, tuple[str, ...], Future] | None = None
        # One thread for the store's life (see BackgroundCalls on why not one per refresh).
        self._prefetcher = BackgroundCalls(f"delta-prefetch-{policy}")

    @classmethod
    def from_config(cls, cfg: ClusterConfig, policy: str) -> WeightStore:
        return cls(ObjectStore.from_config(cfg), cfg.run, policy)

    # -- writing ---------------------------------------------------------------------------------
    def put_anchor(self, version: int, state: dict[str, torch.Tensor], part: int = 0, parts: int = 1) -> ObjectInfo:
        """Upload a safetensors checkpoint of ``state`` (copied to the host if on a GPU): the whole state, or
        part ``part`` of ``parts`` (its rows)."""
        from safetensors.torch import save_file

        key = self.layout.part_key(self.policy, version, "anchor", part, parts)
        with tempfile.TemporaryDirectory(prefix="astraflow-anchor-") as tmp:
            path = Path(tmp) / "anchor.safetensors"
            save_file({k: t.contiguous().cpu() for k, t in state.items()}, str(path),
                      metadata={"policy": self.policy, "version": str(version)})
            digest = self.objects.put_file(key, path)
            size = path.stat().st_size
        return ObjectInfo(key=key, bytes=size, sha256=digest)

    def put_delta(self, version: int, delta: bytes, part: int = 0, parts: int = 1) -> ObjectInfo:
        key = self.layout.part_key(self.policy, version, "delta", part, parts)
        return ObjectInfo(key=key, bytes=len(delta), sha256=self.objects.put_bytes(key, delta))

    def publish(self, manifest: Manifest) -> str:
        """Write the manifest (conditional put): from now on the version exists. Republishing the
        identical manifest is a no-op; a different one is refused."""
        key = self.layout.manifest_key(self.policy, manifest.version)
        try:
            digest = publish_manifest(self.objects, key, manifest.model_dump(mode="json"))
        except ObjectExistsError:
            raise VersionExistsError(
                f"{self.policy} v{manifest.version} is already published with other contents ({key})"
            ) from None
        self._cache(manifest)
        return digest

    # -- reading ---------------------------------------------------------------------------------
    def _scan(self) -> tuple[set[int], dict[int, list[str]]]:
        """Published versions, and every version directory's keys."""
        published: set[int] = set()
        objects: dict[int, list[str]] = {}
        for key in self.objects.list(self.prefix):
            if key.startswith(self.prefix + SUBSCRIBERS_DIR):
                continue
            try:
                v = parse_version(key)
            except ValueError:
                continue
            if not key.startswith(self.layout.version_prefix(self.policy, v)):
                # Nested under another policy's prefix (`<run>/weights/a/.../weights/b/vN/...`): not ours.
                continue
            objects.setdefault(v, []).append(key)
            # The manifest itself, not any key that ends like one: a node may write under
            # `*/weights/*/subscribers/*`, which matches `<run>/weights/pi/v00000099/subscribers/manifest.json`.
            if key == self.layout.manifest_key(self.policy, v):
                published.add(v)
        return published, objects

    def versions(self) -> list[int]:
        """Published versions, ascending (one LIST; manifests already read are forgotten if gone)."""
        published, _ = self._scan()
        for v in list(self._manifests):
            if v not in published:
                del self._manifests[v]
        return sorted(published)

    def latest_version(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def manifest(self, version: int) -> Manifest:
        cached = self._manifests.get(version)
        if cached is not None:
            return cached
        try:
            raw = self.objects.get_json(self.layout.manifest_key(self.policy, version))
        except ObjectNotFoundError:
            raise VersionNotFoundError(f"{self.policy} v{version} is not published") from None
        manifest = Manifest.model_validate(raw)
        self._cache(manifest)  # forgotten at once when older than every cached one: still returned
        return manifest

    def remember(self, manifest: Manifest) -> None:
        """Cache ``manifest``, received with its version's announcement, as if read from the bucket:
        the announcement is sent after the manifest is published, by the publisher that wrote it.
        The objects it names are still checked when read (sha256, then CRC-32C per tensor)."""
        if manifest.policy != self.policy:
            raise ValueError(f"a manifest of {manifest.policy!r} given to the weight store of {self.policy!r}")
        if manifest.version not in self._manifests:
            self._cache(manifest)

    def _cache(self, manifest: Manifest) -> None:
        """Keep ``manifest``, forgetting the oldest beyond :data:`MANIFESTS_CACHED`."""
        self._manifests[manifest.version] = manifest
        while len(self._manifests) > MANIFESTS_CACHED:
            del self._manifests[min(self._manifests)]

    def manifests(self) -> dict[int, Manifest]:
        return {v: self.manifest(v) for v in self.versions()}

    def plan(self, have: int | None, want: int | None = None, avoid: Collection[str] = ()) -> Plan:
        """The cheapest anchor + delta path from ``have`` to ``want`` (default: the latest). A
        ``want`` at most :data:`NEAR_VERSIONS` ahead reads only the manifests in between: an anchor at
        or before ``have`` cannot beat the deltas after ``have``, so listing the bucket (which grows
        with the run) is only needed when those do not make a path."""
        if have is not None and want is not None and 0 < want - have <= NEAR_VERSIONS:
            near = self._manifests_between(have, want)
            if near is not None:
                try:
                    return plan_path(near, have, want, avoid)
                except NoPathError:
                    pass  # a refused or missing delta in the way: plan over every version
        manifests = self.manifests()
        if want is None:
            if not manifests:
                raise VersionNotFoundError(f"no version of {self.policy} is published")
            want = max(manifests)
        return plan_path(manifests, have, want, avoid)

    def _manifests_between(self, have: int, want: int) -> dict[int, Manifest] | None:
        """The manifests of versions ``have + 1 .. want`` (cached ones are not read again), or None
        when one of them is not published."""
        try:
            return {v: self.manifest(v) for v in range(have + 1, want + 1)}
        except VersionNotFoundError:
            return None

    def get_anchor(self, version: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The anchor's whole state dict (its parts' rows put together), each tensor checked against
        the manifest's CRC-32C."""
        from safetensors.torch import load_file

        m = self.manifest(version)
        if not m.has_anchor:
            raise VersionNotFoundError(f"{self.policy} v{version} has no anchor")
        state: dict[str, torch.Tensor] = {}
        with tempfile.TemporaryDirectory(prefix="astraflow-anchor-") as tmp:
            path = Path(tmp) / "anchor.safetensors"
            for i, part in enumerate(m.parts):
                digest = self._read_part(m, i, part.anchor, lambda key: self.objects.get_file(key, path))
                if digest != part.anchor.sha256:
                    raise DeltaCorruptError(f"anchor {part.anchor.key} is not the object its manifest names (sha256)")
                rows = load_file(str(path), device=str(device or "cpu"))
                if part.rows is None:
                    state = rows
                    continue
                if set(rows) != set(part.rows):
                    raise DeltaCorruptError(f"anchor part {part.anchor.key} holds other tensors than its manifest says")
                for name, t in rows.items():
                    if name not in state:
                        state[name] = torch.empty(m.shapes[name], dtype=t.dtype, device=t.device)
                    view = row_view(state[name], part.rows[name])
                    if view.shape != t.shape or view.dtype != t.dtype:
                        raise DeltaCorruptError(f"anchor part {part.anchor.key}: {name!r} is {t.dtype}{list(t.shape)}, "
                                                f"its rows {view.dtype}{list(view.shape)}")
                    view.copy_(t)
        check_state(state, m)
        return state

    def prefetch_delta(self, version: int) -> None:
        """Start reading the delta of ``version`` from its usual key(s) on the store's prefetch thread,
        so that it downloads while the manifest is read: :meth:`get_delta` takes it when the manifest
        names those objects, and checks them as always. The part count is guessed from the newest
        manifest read (one part when none). A miss (no delta there, an error) only costs the requests:
        ``get_delta`` reads the objects itself then. Only the newest prefetch is kept."""
        parts = len(self._manifests[max(self._manifests)].parts) if self._manifests else 1
        keys = tuple(self.layout.part_key(self.policy, version, "delta", i, parts) for i in range(parts))
        self._prefetched = (version, keys, self._prefetcher.submit(
            lambda: [self.objects.get_bytes_with_sha256(key) for key in keys]))

    def _take_prefetched(self, version: int, keys: tuple[str, ...]) -> list[tuple[bytes, str]] | None:
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is None or prefetched[:2] != (version, keys):
            return None
        try:
            return prefetched[2].result()
        except Exception:  # noqa: BLE001 - read them again below, where the error is raised
            return None

    def get_delta(self, version: int) -> list[tuple[Rows | None, bytes]]:
        """The delta parts of ``version``: ``(rows, blob)`` each (rows None: the whole state), each
        object checked against the sha256 its manifest names."""
        m = self.manifest(version)
        if not m.has_delta:
            raise VersionNotFoundError(f"{self.policy} v{version} has no delta")
        keys = tuple(m.delta_keys)
        fetched = self._take_prefetched(version, keys)
        out = []
        for i, part in enumerate(m.parts):
            blob, digest = fetched[i] if fetched is not None else self._read_part(
                m, i, part.delta, self.objects.get_bytes_with_sha256)
            if digest != part.delta.sha256:
                raise DeltaCorruptError(f"delta {part.delta.key} is not the object its manifest names (sha256)")
            out.append((part.rows, blob))
        return out

    def _read_part(self, m: Manifest, i: int, obj: ObjectInfo, read):
        """``read(obj.key)``; a part of a version still published that is not in the bucket is refused by
        name (:class:`DeltaCorruptError`): a missing object of a collected version is not (re-plan)."""
        try:
            return read(obj.key)
        except ObjectNotFoundError:
            if not self.objects.exists(self.layout.manifest_key(self.policy, m.version)):
                raise
            raise DeltaCorruptError(f"{self.policy} v{m.version}: part {i} of {len(m.parts)} ({obj.key}) is "
                                    "missing from the bucket") from None

    # -- subscribers -----------------------------------------------------------------------------
    def subscriber_key(self, subscriber_id: str) -> str:
        if not NAME_RE.match(subscriber_id):
            raise ValueError(f"invalid subscriber id {subscriber_id!r}")
        return f"{self.prefix}{SUBSCRIBERS_DIR}{subscriber_id}.json"

    def register_subscriber(self, subscriber_id: str, version: int | None, now: float | None = None, *,
                            loading: int | None = None) -> None:
        record = SubscriberRecord(id=subscriber_id, version=version, heartbeat=time.time() if now is None else now,
                                  loading=loading)
        self.objects.put_json(self.subscriber_key(subscriber_id), record.model_dump())

    def unregister_subscriber(self, subscriber_id: str) -> None:
        self.objects.delete(self.subscriber_key(subscriber_id))

    def subscribers(self) -> list[SubscriberRecord]:
        out = []
        for key in self.objects.list(self.prefix + SUBSCRIBERS_DIR):
            try:
                out.append(SubscriberRecord.model_validate(self.objects.get_json(key)))
            except ObjectNotFoundError:
                continue  # unregistered meanwhile
        return out

    # -- retention -------------------------------------------------------------------------------
    def gc(self, policy: RetentionPolicy | None = None, *, dry_run: bool = False, now: float | None = None) -> GcPlan:
        """Apply the retention rule (:mod:`astraflow.delta.retention`); return what was (or, with
        ``dry_run``, would be) kept and deleted."""
        policy = policy or RetentionPolicy()
        published, objects = self._scan()
        anchors = {v: self.manifest(v).has_anchor for v in published}
        unpublished = [v for v in objects if v not in published]
        plan = plan_gc(anchors, unpublished, self.subscribers(), policy, time.time() if now is None else now)
        if dry_run:
            return plan
        for v in plan.delete:
            manifest_key = self.layout.manifest_key(self.policy, v)
            self.objects.delete(manifest_key)  # unpublish first: readers never see dangling manifests
            self.objects.delete_many(k for k in objects[v] if k != manifest_key)
            self._manifests.pop(v, None)
        for v in plan.orphans:
            self.objects.delete_many(objects[v])
        for sub in plan.expired:
            self.objects.delete(self.subscriber_key(sub.id))
        return plan


def state_crcs(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: tensor_checksum(t) for name, t in state.items()}


def check_state(state: MutableMapping[str, torch.Tensor] | dict, manifest: Manifest) -> None:
    """Refuse a state whose names or bits differ from what the manifest records."""
    if set(state) != set(manifest.tensors):
        raise DeltaCorruptError(
            f"v{manifest.version}: tensor names differ from the manifest "
            f"({len(state)} vs {len(manifest.tensors)} tensors)"
        )
    for name, t in state.items():
        if tensor_checksum(t) != manifest.tensors[name]:
            raise DeltaCorruptError(f"v{manifest.version}: {name!r} ({dtype_name(t.dtype)}) fails its checksum")
