"""Which versions garbage collection keeps, and why.

The rule, with ``L`` the latest published version and ``A`` the latest anchor at or below ``L``:

1. keep ``A`` and every version after it (``A .. L``): a new subscriber needs the anchor and its
   chain;
2. keep the ``keep_versions`` most recent versions (``L-keep_versions+1 .. L``): subscribers a few
   versions behind take one or a few deltas;
3. keep, for every *live* subscriber at version ``s``, the versions ``s+1 .. L``: the delta chain
   it still needs. A subscriber is live while its record
   (``<run>/weights/<policy>/subscribers/<id>.json``: id, version, heartbeat time) is younger than
   ``subscriber_ttl_s``; older records are expired and deleted. A subscriber in the middle of a load also
   keeps the versions from the first one it reads (``loading``), its record refreshed while it loads;
4. keep the ``pinned`` versions (a KL objective's reference policy, v0);
5. delete every other published version (its manifest first, then its objects, so no reader ever
   sees a manifest whose objects are gone), and objects of unpublished versions below ``L`` (a
   publisher that died between upload and manifest). Versions above ``L`` are never touched: they
   may be uploading right now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict


class SubscriberRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    """Subscriber id (unique per rollout node / process)."""
    version: int | None
    """Version the subscriber holds (None: nothing yet)."""
    heartbeat: float
    """Unix time of its last heartbeat."""
    loading: int | None = None
    """While a load runs: the first version it reads (it needs that one and every later one); None
    otherwise (:mod:`astraflow.delta.load_heartbeat`)."""


@dataclass(frozen=True)
class RetentionPolicy:
    keep_versions: int = 2
    """Most recent versions always kept."""
    subscriber_ttl_s: float = 600.0
    """A subscriber whose heartbeat is older than this is dead: it pins nothing."""
    pinned: tuple[int, ...] = ()
    """Versions kept whatever the rest of the rule says: v0 while a trainer's KL objective reads it as its
    reference policy (at every start, :mod:`astraflow.trainer.service`)."""


@dataclass
class GcPlan:
    latest: int | None
    keep: dict[int, str] = field(default_factory=dict)  # version -> why
    delete: list[int] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)  # unpublished versions below latest
    live: list[SubscriberRecord] = field(default_factory=list)
    expired: list[SubscriberRecord] = field(default_factory=list)


def plan_gc(
    anchors: Mapping[int, bool],
    unpublished: list[int],
    subscribers: list[SubscriberRecord],
    policy: RetentionPolicy,
    now: float,
) -> GcPlan:
    """``anchors``: published version -> whether it holds an anchor."""
    versions = sorted(anchors)
    if not versions:
        return GcPlan(None)
    latest = versions[-1]
    plan = GcPlan(latest)
    for sub in subscribers:
        (plan.live if now - sub.heartbeat <= policy.subscriber_ttl_s else plan.expired).append(sub)

    def keep(lo: int, why: str) -> None:
        for v in versions:
            if v >= lo:
                plan.keep.setdefault(v, why)

    anchor_versions = [v for v in versions if anchors[v]]
    if anchor_versions:
        keep(anchor_versions[-1], f"latest anchor v{anchor_versions[-1]} and its chain")
    keep(latest - policy.keep_versions + 1, f"one of the {policy.keep_versions} most recent")
    for sub in plan.live:
        if sub.version is not None:
            keep(sub.version + 1, f"chain of live subscriber {sub.id} (at v{sub.version})")
        if sub.loading is not None:
            keep(sub.loading, f"being loaded by live subscriber {sub.id} (from v{sub.loading})")
    for v in policy.pinned:
        if v in anchors:
            plan.keep.setdefault(v, f"pinned v{v}")
    plan.delete = [v for v in versions if v not in plan.keep]
    plan.orphans = sorted(v for v in unpublished if v < latest)
    return plan
