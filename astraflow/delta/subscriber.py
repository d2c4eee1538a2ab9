"""Rollout side: follow a policy's versions and bring a state dict or a model to one of them.

``pull(to_version)`` keeps a state dict of the subscriber's own and returns it; ``apply_to(model)``
writes into a model's (or a caller's state dict's) tensors in place. Either way the subscriber
plans the cheapest path in bytes (:mod:`astraflow.delta.planner`) from the version it holds, applies
deltas with the codec (which refuses a base that is not exactly the expected version: then the
subscriber resyncs from an anchor), counts the bytes it downloads, and registers the version it
holds in the bucket (``subscribers/<id>.json``) so garbage collection keeps its chain.

A subscriber follows one state: call either ``pull`` or ``apply_to`` (always on the same target).
``latest_version()`` asks the bucket (the source of truth); ``wait_for_version`` blocks on the
``<run>.weights.<policy>`` announcements and confirms in the bucket.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Self

import torch

from astraflow.delta.codec import apply_inplace
from astraflow.delta.errors import BaseMismatchError, DeltaError, NoPathError
from astraflow.delta.format import read_header
from astraflow.delta.planner import Plan
from astraflow.delta.store import WeightStore
from astraflow.objstore.errors import ObjectNotFoundError

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig

StateDict = MutableMapping[str, torch.Tensor]


class WeightSubscriber:
    def __init__(
        self,
        cfg: ClusterConfig,
        policy: str,
        subscriber_id: str,
        *,
        store: WeightStore | None = None,
        register: bool = True,
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self.subscriber_id = subscriber_id
        self.store = store or WeightStore.from_config(cfg, policy)
        self.register = register
        self.version: int | None = None
        self.bytes_pulled = 0
        """Bytes downloaded from the bucket over this subscriber's life."""
        self._state: dict[str, torch.Tensor] | None = None
        self._consumer = None

    # -- versions --------------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        return self.store.latest_version()

    def wait_for_version(self, at_least: int, timeout_s: float = 30.0) -> int | None:
        """Block until a version >= ``at_least`` is published (announcement, confirmed by the
        bucket); return the latest version, or None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            latest = self.latest_version()
            if latest is not None and latest >= at_least:
                return latest
            if time.monotonic() >= deadline:
                return None
            consumer = self._announcements()
            for msg in consumer.poll(timeout_s=min(1.0, max(0.0, deadline - time.monotonic()))):
                consumer.commit([msg])

    def _announcements(self) -> Any:
        if self._consumer is None:
            from astraflow.log import LogConsumer, Topics, ensure_topics
            from astraflow.log.codec import WEIGHT_ANNOUNCEMENT_SCHEMA

            topic = Topics(self.cfg.run).weights(self.policy)
            ensure_topics(self.cfg, {topic: 1})
            # One group per subscriber: every subscriber sees every announcement.
            self._consumer = LogConsumer(
                self.cfg, topic, f"{self.cfg.run}.weights.{self.policy}.{self.subscriber_id}",
                {topic: WEIGHT_ANNOUNCEMENT_SCHEMA}, auto_offset_reset="latest",
            )
        return self._consumer

    # -- pulling ---------------------------------------------------------------------------------
    def pull(self, to_version: int | None = None) -> tuple[dict[str, torch.Tensor], int, int]:
        """Bring the subscriber's own state to ``to_version`` (default: latest). Returns
        ``(state_dict, version, bytes downloaded by this call)``; the state dict is the
        subscriber's and is updated in place by later pulls."""
        pulled = self._advance(None, to_version)
        return self._state, self.version, pulled

    def apply_to(self, target: torch.nn.Module | StateDict, to_version: int | None = None) -> tuple[int, int]:
        """Bring ``target`` (an ``nn.Module`` or a state dict, at :attr:`version`; anything when
        :attr:`version` is None) to ``to_version`` in place. Returns ``(version, bytes downloaded
        by this call)``."""
        pulled = self._advance(_writable_state(target), to_version)
        return self.version, pulled

    def _advance(self, into: StateDict | None, to_version: int | None) -> int:
        before = self.bytes_pulled
        resync = False
        for attempt in range(3):
            held = self._state if into is None else into
            have = None if resync or held is None else self.version
            try:
                self._execute(self.store.plan(have, to_version), into)
                break
            except ObjectNotFoundError:
                if attempt == 2:
                    raise
                # collected while we planned: re-plan with fresh manifests
            except BaseMismatchError:
                if have is None or attempt == 2:
                    raise
                resync = True  # what we hold is not the version we think: resync from an anchor
        if self.register:
            self.store.register_subscriber(self.subscriber_id, self.version)
        return self.bytes_pulled - before

    def _execute(self, plan: Plan, into: StateDict | None) -> None:
        state = self._state if into is None else into
        for step in plan.steps:
            if step.kind == "anchor":
                anchor = self.store.get_anchor(step.version)
                if into is None:
                    self._state = state = anchor
                else:
                    _copy_into(into, anchor)
            else:
                blob = self.store.get_delta(step.version)
                if into is not None and any(t.op in ("full", "removed") for t in read_header(blob).tensors):
                    raise DeltaError(f"v{step.version} changes tensor names/shapes: pull() a state dict instead")
                apply_inplace(state, blob, base_version=step.version - 1)
            self.version = step.version
            self.bytes_pulled += step.bytes
        self.version = plan.want

    # -- lifecycle -------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Refresh this subscriber's registration (do it more often than the GC's subscriber TTL)."""
        self.store.register_subscriber(self.subscriber_id, self.version)

    def close(self, *, unregister: bool = True) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
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
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
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
