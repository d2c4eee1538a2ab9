"""Rollout side: follow a policy's versions and bring a state dict or a model to one of them.

``pull(to_version)`` keeps a state dict of the subscriber's own and returns it; ``apply_to(model)``
writes into a model's (or a caller's state dict's) tensors in place. Either way the subscriber
plans the cheapest path in bytes (:mod:`astraflow.delta.planner`) from the version it holds, applies
deltas with the codec (which refuses a base that is not exactly the expected version: then the
subscriber resyncs from an anchor), counts the bytes it downloads, and registers the version it
holds in the bucket (``subscribers/<id>.json``) so garbage collection keeps its chain; while a load runs,
the record names the first version it reads and is kept fresh (:mod:`astraflow.delta.load_heartbeat`), so
garbage collection keeps what it is reading too.

An object that fails verification (its bytes do not match the sha256 stored with it or named by its
manifest, a delta the codec refuses, a delta that does not fit the anchor it was planned from) is
refused: one log line names it and the reason, :attr:`refused` keeps it, and the subscriber plans
again without it (another anchor, or :class:`NoPathError` until a later anchor is published). The
state it holds stays the last version it reached. A refused object is not fetched again.

A serving engine is brought forward by ``prepare_patch`` (fetch and decode the deltas, nothing
written), the engine writing the patch between two decoding steps, and ``patched``; see
:mod:`astraflow.delta.patch`.

A subscriber follows one state: call either ``pull`` or ``apply_to`` (always on the same target).
``latest_version()`` asks the bucket (the source of truth); ``wait_for_version`` blocks on the
``<run>.weights.<policy>`` announcements and confirms in the bucket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Self

import torch

from astraflow.delta.bits import storage_key
from astraflow.delta.errors import (
    BaseMismatchError,
    BaseVersionError,
    DeltaCorruptError,
    DeltaError,
    DeltaFormatError,
    NoPathError,
)
from astraflow.delta.format import read_header
from astraflow.delta.load_heartbeat import LOAD_HEARTBEAT_S, LoadHeartbeat
from astraflow.delta.parts import apply_parts_inplace
from astraflow.delta.patch import WeightPatch, prepare_patch
from astraflow.delta.planner import Plan, Step
from astraflow.delta.store import WeightStore
from astraflow.objstore.errors import ChecksumError, ObjectNotFoundError

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

StateDict = MutableMapping[str, torch.Tensor]
log = logging.getLogger(__name__)


def refusal_reason(exc: BaseException) -> str:
    """The counted reason a weight object was refused for."""
    if isinstance(exc, ChecksumError):
        return "checksum"  # the bytes read are not those written (sha256 in the object's metadata)
    if isinstance(exc, DeltaCorruptError):
        return "corrupt"  # not the object the manifest names, or the codec's own checksums fail
    if isinstance(exc, DeltaFormatError):
        return "format"
    if isinstance(exc, (BaseVersionError, BaseMismatchError)):
        return "base"
    return "invalid"


class _BadObject(Exception):
    """Internal: ``step``'s object (of one of its parts: ``keys``) failed verification; the cause says how."""

    def __init__(self, step: Step, keys: list[str]) -> None:
        super().__init__(", ".join(keys))
        self.step = step
        self.keys = keys


def refused_keys(step: Step, exc: BaseException) -> list[str]:
    """The objects of ``step`` that ``exc`` refuses: the part it names (a version in parts is refused
    part by part), or every object of the step when it names none."""
    if isinstance(exc, ChecksumError) and exc.key in step.keys:
        return [exc.key]
    named = [key for key in step.keys if key in str(exc)]
    return named or list(step.keys)


class WeightSubscriber:
    def __init__(
        self,
        cfg: ClusterConfig,
        policy: str,
        subscriber_id: str,
        *,
        store: WeightStore | None = None,
        register: bool = True,
        record_every_s: float = 0.0,
        load_heartbeat_s: float = LOAD_HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``record_every_s``: the least time between two writes of this subscriber's record (its
        version, for the GC) after the first; 0 writes it at every new version. A node refreshing
        every step otherwise PUTs a record per version (100 nodes at 10 versions/s: 1,000 PUTs/s on
        one prefix). A record that lags the version held only makes the GC keep a few more versions.
        ``load_heartbeat_s``: while a load runs, the record (with the first version the load reads) is
        rewritten this often, so that the GC keeps what it reads (:mod:`astraflow.delta.load_heartbeat`)."""
        self.cfg = cfg
        self.policy = policy
        self.subscriber_id = subscriber_id
        self.store = store or WeightStore.from_config(cfg, policy)
        self.register = register
        self.record_every_s = record_every_s
        self.load_heartbeat_s = load_heartbeat_s
        self._loading_recorded = False
        """A record naming a load was written: the next record is written whatever ``record_every_s`` says."""
        self._clock = clock
        self._recorded_at: float | None = None
        self.version: int | None = None
        self.bytes_pulled = 0
        """Bytes downloaded from the bucket over this subscriber's life."""
        self.refused: dict[str, str] = {}
        """Objects refused (key -> reason, see :func:`refusal_reason`); plans avoid them."""
        self._state: dict[str, torch.Tensor] | None = None

    # -- versions --------------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        return self.store.latest_version()

    # -- pulling ---------------------------------------------------------------------------------
    def pull(self, to_version: int | None = None, *, register: bool = True) -> tuple[dict[str, torch.Tensor], int, int]:
        """Bring the subscriber's own state to ``to_version`` (default: latest). Returns
        ``(state_dict, version, bytes downloaded by this call)``; the state dict is the
        subscriber's and is updated in place by later pulls. ``register=False`` leaves the
        subscriber's record in the bucket to a later :meth:`heartbeat` (a node serves first)."""
        pulled = self._advance(None, to_version, register=register)
        return self._state, self.version, pulled

    def apply_to(self, target: torch.nn.Module | StateDict, to_version: int | None = None) -> tuple[int, int]:
        """Bring ``target`` (an ``nn.Module`` or a state dict, at :attr:`version`; anything when
        :attr:`version` is None) to ``to_version`` in place. Returns ``(version, bytes downloaded
        by this call)``."""
        pulled = self._advance(_writable_state(target), to_version)
        return self.version, pulled

    def prepare_patch(self, live: StateDict, to_version: int | None = None) -> WeightPatch | None:
        """The deltas from :attr:`version` (the version ``live``, an engine's tensors, holds) to
        ``to_version`` (default: latest), fetched and decoded without touching ``live``
        (:mod:`astraflow.delta.patch`): the engine pauses only for :meth:`WeightPatch.write`, then
        :meth:`patched` records the new version. None when there is nothing to do, or the way there
        needs a full load (an anchor, a refused or non-patchable delta): use ``pull`` / ``apply_to``."""
        if self.version is None:
            return None
        want = self.store.latest_version() if to_version is None else to_version
        if want is None or want <= self.version:
            return None
        self._prefetch_next(want)
        plan = self.store.plan(self.version, want, avoid=self.refused)
        if not plan.steps or any(step.kind != "delta" for step in plan.steps):
            return None
        deltas = []
        for step in plan.steps:
            try:
                deltas.append((step.version, self.store.get_delta(step.version),
                               self.store.manifest(step.version).tensors))
            except (ChecksumError, DeltaError) as exc:
                self._refuse(step, refused_keys(step, exc), exc)
                return None
        try:
            patch = prepare_patch(live, deltas, self.version)
        except BaseMismatchError:  # the engine's tensors do not fit the deltas (names, dtypes, shapes)
            raise
        except DeltaError as exc:  # corrupt, or a tensor added / reshaped: the full path refuses or loads it
            log.info("%s: %s v%d -> v%d cannot be patched in place: %s", self.subscriber_id, self.policy,
                     self.version, want, exc)
            return None
        patch.bytes = plan.bytes
        return patch

    def patched(self, patch: WeightPatch) -> None:
        """``patch`` was written into the engine's tensors: they hold ``patch.version`` now. The
        subscriber keeps no copy of its own from here on (the engine's tensors are the state)."""
        self._state = None
        self.version = patch.version
        self.bytes_pulled += patch.bytes
        self._record()

    def _advance(self, into: StateDict | None, to_version: int | None, *, register: bool = True) -> int:
        before = self.bytes_pulled
        resync = False
        attempt = 0
        refusal: BaseException | None = None
        if self._state is not None or into is not None:
            self._prefetch_next(to_version)
        while True:  # ends: each refusal removes an object from the plans; other retries are bounded
            held = self._state if into is None else into
            have = None if resync or held is None else self.version
            try:
                try:
                    plan = self.store.plan(have, to_version, avoid=self.refused)
                except NoPathError as exc:
                    if refusal is None:
                        raise
                    raise exc from refusal  # the refusal in this call is why
                self._execute(plan, into)
                break
            except ObjectNotFoundError:
                attempt += 1
                if attempt == 3:
                    raise
                # collected while we planned: re-plan with fresh manifests
            except _BadObject as bad:
                exc = bad.__cause__
                if isinstance(exc, BaseMismatchError) and have is not None and not resync:
                    resync = True  # what we hold is not the version we think: resync from an anchor
                    continue
                refusal = exc
                self._refuse(bad.step, bad.keys, exc)
        if register:
            self._record()
        return self.bytes_pulled - before

    def _refuse(self, step: Step, keys: list[str], exc: BaseException) -> None:
        reason = refusal_reason(exc)
        for key in keys:
            self.refused[key] = reason
        log.warning("%s: refused %s v%d object %s (%s): %s", self.subscriber_id, self.policy,
                    step.version, ", ".join(keys), reason, exc)

    def _prefetch_next(self, want: int | None) -> None:
        """The usual refresh, one version ahead (a node following announcements): its delta downloads
        while the store reads the manifest that names it."""
        if want is not None and self.version is not None and want == self.version + 1:
            self.store.prefetch_delta(want)

    def _execute(self, plan: Plan, into: StateDict | None) -> None:
        if not self.register or not plan.steps:
            self._load(plan, into)
            return
        first = plan.steps[0].version

        def loading() -> None:
            self.store.register_subscriber(self.subscriber_id, self.version, loading=first)

        full = any(step.kind == "anchor" for step in plan.steps)
        with LoadHeartbeat(loading, self.load_heartbeat_s, at_once=full, name=self.subscriber_id) as beat:
            self._load(plan, into)
        self._loading_recorded |= beat.wrote

    def _load(self, plan: Plan, into: StateDict | None) -> None:
        state = self._state if into is None else into
        for step in plan.steps:
            if step.kind == "anchor":
                try:
                    anchor = self.store.get_anchor(step.version)
                except (ChecksumError, DeltaError) as exc:
                    raise _BadObject(step, refused_keys(step, exc)) from exc
                if into is None:
                    self._state = state = anchor
                else:
                    _copy_into(into, anchor)
            else:
                try:
                    parts = self.store.get_delta(step.version)
                    headers = [read_header(blob) for _rows, blob in parts]
                except (ChecksumError, DeltaError) as exc:
                    raise _BadObject(step, refused_keys(step, exc)) from exc
                if into is not None and any(t.op in ("full", "removed") for h in headers for t in h.tensors):
                    raise DeltaError(f"v{step.version} changes tensor names/shapes: pull() a state dict instead")
                try:
                    apply_parts_inplace(state, parts, step.version - 1, names=list(step.keys))
                except DeltaError as exc:  # refused before writing: the state is still step.version - 1
                    raise _BadObject(step, refused_keys(step, exc)) from exc
            self.version = step.version
            self.bytes_pulled += step.bytes
        self.version = plan.want

    # -- lifecycle -------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Refresh this subscriber's registration (do it more often than the GC's subscriber TTL; at
        most every ``record_every_s``)."""
        self._record()

    def _record(self) -> None:
        """Write this subscriber's record (id, version, heartbeat time), unless one was written less
        than ``record_every_s`` ago."""
        if not self.register:
            return
        now = self._clock()
        if (self._recorded_at is not None and now - self._recorded_at < self.record_every_s
                and not self._loading_recorded):
            return
        self.store.register_subscriber(self.subscriber_id, self.version)
        self._recorded_at = now
        self._loading_recorded = False

    def close(self, *, unregister: bool = True) -> None:
        if unregister and self.register:
            self.store.unregister_subscriber(self.subscriber_id)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _writable_state(target: torch.nn.Module | StateDict) -> StateDict:
    """Tensors to write in place. Tied weights (one storage under two names) appear once; the other
    names get scratch copies, so a delta is not XORed twice into the same bits."""
    # A shallow copy: writes go through to the target's tensors, scratch copies stay here.
    sd = dict(target.state_dict() if isinstance(target, torch.nn.Module) else target)
    seen: set[tuple] = set()
    for name, t in list(sd.items()):
        key = storage_key(t)
        if key in seen:
            sd[name] = t.detach().clone()
        seen.add(key)
    return sd


def _copy_into(into: StateDict, source: dict[str, torch.Tensor]) -> StateDict:
    if set(into) != set(source):
        raise NoPathError("the anchor's tensor names differ from the target's; pull() a state dict instead")
    with torch.no_grad():
        for name, t in source.items():
            dst = into[name]
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise NoPathError(f"anchor {name!r} is {t.dtype}{list(t.shape)}, the target {dst.dtype}{list(dst.shape)}")
            dst.copy_(t)
    return into
