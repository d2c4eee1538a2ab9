"""Path planning and the retention rule, on manifests alone (no bucket)."""

from __future__ import annotations

import pytest

from astraflow.delta.errors import NoPathError, VersionNotFoundError
from astraflow.delta.manifest import Manifest, ObjectInfo
from astraflow.delta.planner import plan_path
from astraflow.delta.retention import RetentionPolicy, SubscriberRecord, plan_gc


def manifest(v: int, *, anchor: int | None = None, delta: int | None = None) -> Manifest:
    return Manifest(
        policy="pi", version=v, kind="anchor" if anchor else "delta",
        base=v - 1 if delta else None,
        anchor=ObjectInfo(key=f"a{v}", bytes=anchor, sha256="x") if anchor else None,
        delta=ObjectInfo(key=f"d{v}", bytes=delta, sha256="x") if delta else None,
        params=1, full_bytes=1000, tensors={}, state_digest="x",
    )


def store(n: int, anchor_every: int, anchor_bytes: int = 1000, delta_bytes: int = 10) -> dict[int, Manifest]:
    return {
        v: manifest(v, anchor=anchor_bytes if v % anchor_every == 0 else None, delta=delta_bytes if v else None)
        for v in range(n + 1)
    }


def kinds(plan) -> list[tuple[str, int]]:
    return [(s.kind, s.version) for s in plan.steps]


def test_one_behind_takes_one_delta():
    assert kinds(plan_path(store(30, 10), 29, 30)) == [("delta", 30)]


def test_far_behind_takes_anchor_when_cheaper():
    # 25 deltas of 100 B (2500) lose to the anchor at 30 (1000).
    plan = plan_path(store(30, 10, delta_bytes=100), 5, 30)
    assert kinds(plan) == [("anchor", 30)]
    plan = plan_path(store(33, 10, delta_bytes=100), 5, 33)
    assert kinds(plan) == [("anchor", 30), ("delta", 31), ("delta", 32), ("delta", 33)]
    assert plan.bytes == 1300


def test_chain_of_deltas_when_cheaper_than_anchor():
    plan = plan_path(store(30, 10, delta_bytes=10), 5, 30)
    assert kinds(plan) == [("delta", v) for v in range(6, 31)]


def test_fresh_subscriber_takes_nearest_anchor_and_chain():
    assert kinds(plan_path(store(34, 10), None, 34)) == [("anchor", 30)] + [("delta", v) for v in (31, 32, 33, 34)]


def test_gap_in_deltas_forces_anchor():
    ms = store(30, 10, delta_bytes=10)
    del ms[25]  # collected
    assert kinds(plan_path(ms, 27, 30)) == [("delta", 28), ("delta", 29), ("delta", 30)]
    with pytest.raises(NoPathError):  # v25 gone, no anchor in 25..28 and 22->28 is broken
        plan_path(ms, 22, 28)
    assert kinds(plan_path(ms, 22, 30)) == [("anchor", 30)]


def test_unknown_or_unreachable_version_refused():
    ms = store(12, 10)
    with pytest.raises(VersionNotFoundError):
        plan_path(ms, None, 13)
    del ms[10]
    del ms[0]
    with pytest.raises(NoPathError):
        plan_path(ms, None, 12)
    assert plan_path(ms, 12, 12).steps == []


def rule(n: int, anchor_every: int, subs=(), keep: int = 2, now: float = 1000.0):
    anchors = {v: v % anchor_every == 0 for v in range(n + 1)}
    records = [SubscriberRecord(id=i, version=v, heartbeat=hb) for i, v, hb in subs]
    return plan_gc(anchors, [], records, RetentionPolicy(keep_versions=keep, subscriber_ttl_s=60), now)


def test_gc_keeps_latest_anchor_and_its_chain():
    plan = rule(34, 10)
    assert sorted(plan.keep) == [30, 31, 32, 33, 34]
    assert plan.delete == list(range(30))


def test_gc_keeps_recent_versions_right_after_an_anchor():
    plan = rule(30, 10, keep=3)
    assert sorted(plan.keep) == [28, 29, 30]


def test_gc_keeps_chain_of_live_subscribers_only():
    plan = rule(34, 10, subs=[("slow", 17, 990.0), ("dead", 3, 100.0)])
    assert sorted(plan.keep) == list(range(18, 35))
    assert [s.id for s in plan.live] == ["slow"] and [s.id for s in plan.expired] == ["dead"]
    assert plan.delete == list(range(18))


def test_gc_keeps_a_pinned_version_alone():
    """A KL objective's reference (v0) survives the in-run GC; the versions after it do not."""
    anchors = {v: v % 10 == 0 for v in range(35)}
    plan = plan_gc(anchors, [], [], RetentionPolicy(keep_versions=2, subscriber_ttl_s=60, pinned=(0,)), 1000.0)
    assert sorted(plan.keep) == [0, 30, 31, 32, 33, 34] and plan.keep[0] == "pinned v0"
    assert plan.delete == list(range(1, 30))
