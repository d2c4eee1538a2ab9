"""``WeightStore``: one policy's versions in the bucket — anchors, deltas, manifests, subscribers.

Layout (``RunLayout``)::

    <run>/weights/<policy>/v00000010/anchor.safetensors   full checkpoint, every K versions
    <run>/weights/<policy>/v00000011/delta.zst            codec delta v10 -> v11
    <run>/weights/<policy>/v00000011/manifest.json        written last, If-None-Match: *
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
from astraflow.delta.planner import Plan, plan_path
from astraflow.delta.retention import GcPlan, RetentionPolicy, SubscriberRecord, plan_gc
from astraflow.objstore import ObjectStore, RunLayout, parse_version, publish_manifest
from astraflow.objstore.errors import ObjectExistsError, ObjectNotFoundError
from astraflow.objstore.layout import MANIFEST_FILE, NAME_RE

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

SUBSCRIBERS_DIR = "subscribers/"
NEAR_VERSIONS = 8
"""How far ahead a plan reads manifests one by one instead of listing the bucket."""


class WeightStore:
    def __init__(self, objects: ObjectStore, run: str, policy: str) -> None:
        self.objects = objects
        self.layout = RunLayout(run)
        self.policy = policy
        self.prefix = self.layout.weights_prefix(policy)
        self._manifests: dict[int, Manifest] = {}
        self._prefetched: tuple[int, str, Future] | None = None
        # One thread for the store's life (see BackgroundCalls on why not one per refresh).
        self._prefetcher = BackgroundCalls(f"delta-prefetch-{policy}")

    @classmethod
    def from_config(cls, cfg: ClusterConfig, policy: str) -> WeightStore:
        return cls(ObjectStore.from_config(cfg), cfg.run, policy)

    # -- writing ---------------------------------------------------------------------------------
    def put_anchor(self, version: int, state: dict[str, torch.Tensor]) -> ObjectInfo:
        """Upload a full safetensors checkpoint of ``state`` (contiguous CPU tensors)."""
        from safetensors.torch import save_file

        key = self.layout.anchor_key(self.policy, version)
        with tempfile.TemporaryDirectory(prefix="astraflow-anchor-") as tmp:
            path = Path(tmp) / "anchor.safetensors"
            save_file(state, str(path), metadata={"policy": self.policy, "version": str(version)})
            digest = self.objects.put_file(key, path)
            size = path.stat().st_size
        return ObjectInfo(key=key, bytes=size, sha256=digest)

    def put_delta(self, version: int, delta: bytes) -> ObjectInfo:
        key = self.layout.delta_key(self.policy, version)
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
        self._manifests[manifest.version] = manifest
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
            objects.setdefault(v, []).append(key)
            if key.endswith("/" + MANIFEST_FILE):
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
        if version not in self._manifests:
            try:
                raw = self.objects.get_json(self.layout.manifest_key(self.policy, version))
            except ObjectNotFoundError:
                raise VersionNotFoundError(f"{self.policy} v{version} is not published") from None
            self._manifests[version] = Manifest.model_validate(raw)
        return self._manifests[version]

    def remember(self, manifest: Manifest) -> None:
        """Cache ``manifest``, received with its version's announcement, as if read from the bucket:
        the announcement is sent after the manifest is published, by the publisher that wrote it.
        The objects it names are still checked when read (sha256, then CRC-32C per tensor)."""
        if manifest.policy != self.policy:
            raise ValueError(f"a manifest of {manifest.policy!r} given to the weight store of {self.policy!r}")
        self._manifests.setdefault(manifest.version, manifest)

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
        """The anchor's state dict, each tensor checked against the manifest's CRC-32C."""
        from safetensors.torch import load_file

        m = self.manifest(version)
        if m.anchor is None:
            raise VersionNotFoundError(f"{self.policy} v{version} has no anchor")
        with tempfile.TemporaryDirectory(prefix="astraflow-anchor-") as tmp:
            path = Path(tmp) / "anchor.safetensors"
            digest = self.objects.get_file(m.anchor.key, path)
            if digest != m.anchor.sha256:
                raise DeltaCorruptError(f"anchor {m.anchor.key} is not the object its manifest names (sha256)")
            state = load_file(str(path), device=str(device or "cpu"))
        check_state(state, m)
        return state

    def prefetch_delta(self, version: int) -> None:
        """Start reading the delta of ``version`` from its usual key on the store's prefetch thread, so
        that it downloads while the manifest is read: :meth:`get_delta` takes it when the manifest names
        that object, and checks it as always. A miss (no delta there, an error) only costs the request:
        ``get_delta`` reads the object itself then. Only the newest prefetch is kept."""
        key = self.layout.delta_key(self.policy, version)
        self._prefetched = (version, key, self._prefetcher.submit(lambda: self.objects.get_bytes_with_sha256(key)))

    def _take_prefetched(self, version: int, key: str) -> tuple[bytes, str] | None:
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is None or prefetched[:2] != (version, key):
            return None
        try:
            return prefetched[2].result()
        except Exception:  # noqa: BLE001 - read it again below, where its error is raised
            return None

    def get_delta(self, version: int) -> bytes:
        m = self.manifest(version)
        if m.delta is None:
            raise VersionNotFoundError(f"{self.policy} v{version} has no delta")
        blob, digest = self._take_prefetched(version, m.delta.key) or self.objects.get_bytes_with_sha256(m.delta.key)
        if digest != m.delta.sha256:
            raise DeltaCorruptError(f"delta {m.delta.key} is not the object its manifest names (sha256)")
        return blob

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
        anchors = {v: self.manifest(v).anchor is not None for v in published}
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
