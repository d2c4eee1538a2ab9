"""A node's weight follower patches an engine's tensors in place (real embedded S3 + broker): after the
first full load, each refresh fetches and decodes the deltas off to the side and pauses the engine
only to write the changed entries; the result is bit-exact and the follower keeps no copy of the
weights. An engine whose tensors cannot take the deltas (an fp32 model fed bf16 weights) refreshes
by full loads, and so does one whose bits were changed behind the follower's back."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from waiting import wait_until

from astraflow.delta import WeightPublisher, carried_manifest
from astraflow.engines.simulated import SimulatedEngine
from astraflow.raas.weights import WeightFollower
from astraflow.records.control import WeightAnnouncement

pytestmark = [pytest.mark.integration]
POLICY = "pi"


def _bits(sd) -> dict:
    return {k: v.contiguous().view(torch.int16 if v.element_size() == 2 else torch.int32).clone()
            for k, v in sd.items()}


class _Trainer:
    """Publishes versions of a small bf16 model, ~1% of entries moving per version."""

    def __init__(self, cluster) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256)).to(torch.bfloat16)
        self.pub = WeightPublisher(cluster, POLICY, anchor_every=100, max_lag_versions=8)
        self.truth: dict[int, dict] = {}

    def publish(self, upto: int) -> None:
        for v in range(len(self.truth), upto + 1):
            if v:
                with torch.no_grad():
                    for p in self.model.parameters():
                        flat = p.view(torch.int16).reshape(-1)
                        hit = torch.randperm(flat.numel())[: flat.numel() // 100]
                        flat[hit] += 1
            self.truth[v] = _bits(self.model.state_dict())
            self.pub.publish(self.model.state_dict(), v)
        self.pub.flush()


def test_refreshes_after_the_first_patch_the_engine_in_place(test_cluster):
    trainer = _Trainer(test_cluster)
    engine = SimulatedEngine()
    follower = WeightFollower(test_cluster, {POLICY: engine}, "node-p", check_every_s=0.3)
    try:
        trainer.publish(1)
        assert follower.catch_up(timeout_s=30) == {POLICY: 1}  # the first load is a full one
        tensors = engine.state_dict()
        trainer.publish(4)
        assert follower.refresh(POLICY) is True
        assert engine.weight_version == 4 and engine.stats.get("patches") == 1
        assert all(torch.equal(_bits(engine.state_dict())[k], trainer.truth[4][k]) for k in trainer.truth[4])
        # Patched in place: the same tensor objects, and no second copy held by the subscriber.
        assert all(engine.state_dict()[k] is t for k, t in tensors.items())
        assert follower.subscribers[POLICY]._state is None and follower.subscribers[POLICY].version == 4
        # Bits changed behind the follower's back: verify catches it and the version is reloaded in full.
        with torch.no_grad():
            engine.state_dict()["1.weight"].view(torch.int16)[0, 0] ^= 1
        trainer.publish(5)
        assert follower.refresh(POLICY) is True and engine.weight_version == 5
        assert all(torch.equal(_bits(engine.state_dict())[k], trainer.truth[5][k]) for k in trainer.truth[5])
        assert engine.stats["patches"] == 2 and engine.stats["loads"] == 2  # patched, found wrong, reloaded
    finally:
        follower.stop()
        trainer.pub.close()


def test_an_engine_in_another_dtype_refreshes_by_full_loads(test_cluster):
    from astraflow.engines.hf import HFEngine

    trainer = _Trainer(test_cluster)

    class Fp32Model(torch.nn.Sequential):  # the published names, fp32 tensors (the HF engine's default)
        pass

    model = Fp32Model(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256)).float()
    engine = HFEngine.__new__(HFEngine)  # only the weight side of the engine is exercised
    engine.model, engine._version = model, 0
    from astraflow.engines.swap_gate import SwapGate

    engine._gate = SwapGate()
    follower = WeightFollower(test_cluster, {POLICY: engine}, "node-f", check_every_s=0.3)
    try:
        trainer.publish(1)
        follower.catch_up(timeout_s=30)
        trainer.publish(3)
        assert follower.refresh(POLICY) is True and engine.weight_version == 3
        assert POLICY in follower._full_loads_only
        want = {k: v.view(torch.bfloat16).float() for k, v in trainer.truth[3].items()}
        assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    finally:
        follower.stop()
        trainer.pub.close()


def _announce_until(trainer, seen: Callable[[], bool], timeout_s: float, what: str, on_timeout=None) -> int:
    """Publish v2, v3, ... (each given 2 s) until ``seen()``: the follower's consumer, joining its
    group, may miss the first announcements. Returns the last version announced."""
    version, announced_at = 1, float("-inf")

    def announced_and_seen() -> bool:
        nonlocal version, announced_at
        if seen():
            return True
        if time.monotonic() - announced_at >= 2.0:
            version += 1
            trainer.publish(version)
            announced_at = time.monotonic()
        return False

    wait_until(announced_and_seen, timeout_s, what, interval_s=0.01, on_timeout=on_timeout)
    return version


def test_an_announced_version_is_refreshed_to_and_counts_as_served_when_the_engine_serves_it(test_cluster):
    """An announcement names its version: the refresh goes there without listing the bucket, and the
    announcement -> serving latency is taken by the refreshing thread the moment the engine serves
    that version (before the subscriber's record is written, the refresh still under way), not by the
    follower thread after its next poll (which added up to 0.1 s to the figure)."""
    import threading

    from astraflow.log import Topics
    from astraflow.log.handoff import HandoffLatency

    trainer = _Trainer(test_cluster)
    engine = SimulatedEngine()
    follower = WeightFollower(test_cluster, {POLICY: engine}, "node-s", check_every_s=60)
    sub = follower.subscribers[POLICY]
    refreshes: list[tuple[int | None, float]] = []  # (the version asked for, the time the refresh ended)
    observed: list[tuple[float, str, int, int | None]] = []  # (time, thread, engine version, subscriber's)

    def clock() -> float:
        observed.append((time.time(), threading.current_thread().name, engine.weight_version, sub.version))
        return observed[-1][0]

    follower.serving = HandoffLatency(clock=clock)
    refresh = follower.refresh

    def traced_refresh(policy: str, announced: int | None = None, serving=None) -> bool:
        try:
            return refresh(policy, announced, serving)
        finally:
            refreshes.append((announced, time.time()))

    follower.refresh = traced_refresh
    try:
        trainer.publish(1)
        follower.catch_up(timeout_s=30)
        follower.start()
        listed = sub.store.latest_version
        sub.store.latest_version = lambda: pytest.fail("an announced refresh listed the bucket")
        deadline = time.monotonic() + 60  # for both waits together
        # announced on the weights topic; the follower refreshes on its own
        _announce_until(trainer, lambda: bool(observed), 60, "an announcement -> serving observation")
        t_obs, thread, serving_version, subscriber_version = observed[0]
        assert thread.startswith("refresh-node-s"), thread
        # the refresh goes on after the observation
        wait_until(lambda: any(a is not None for a, _ in refreshes), max(0.0, deadline - time.monotonic()),
                   "an announced refresh to end", interval_s=0.01, on_timeout=lambda: f"refreshes: {refreshes}")
        asked, t_end = next((a, t) for a, t in refreshes if a is not None)
        assert asked >= 2 and serving_version == asked, (asked, serving_version)
        assert subscriber_version < asked and t_obs <= t_end, (subscriber_version, t_end - t_obs)
        assert f"{Topics(test_cluster.run).weights(POLICY)}:serving" in follower.serving.drain()
        sub.store.latest_version = listed
    finally:
        follower.stop()
        trainer.pub.close()


def test_served_listeners_hear_each_new_version_on_both_refresh_paths(test_cluster):
    """A node's waiting episodes are woken by these calls (RaasNode._await_weights)."""
    from astraflow.engines.hf import HFEngine
    from astraflow.engines.swap_gate import SwapGate

    trainer = _Trainer(test_cluster)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256)).float()
    full = HFEngine.__new__(HFEngine)  # fp32: refreshed by full loads
    full.model, full._version, full._gate = model, 0, SwapGate()
    patched = SimulatedEngine()  # bf16 tensors it exposes: patched in place after the first load
    for engine, node in ((full, "node-lf"), (patched, "node-lp")):
        follower = WeightFollower(test_cluster, {POLICY: engine}, node, check_every_s=0.3)
        heard: list[int] = []
        follower.on_served(lambda engine=engine, heard=heard: heard.append(engine.weight_version))
        try:
            trainer.publish(len(trainer.truth))
            follower.catch_up(timeout_s=30)
            first = engine.weight_version
            trainer.publish(first + 1)
            assert follower.refresh(POLICY) is True
            assert follower.refresh(POLICY) is False  # nothing new: nothing heard
            assert heard == [first, first + 1], node
        finally:
            follower.stop()
    assert patched.stats.get("patches") == 1  # the second engine took the patch path (the first: full loads)
    trainer.pub.close()


def test_an_announced_refresh_takes_the_manifest_from_its_announcement(test_cluster):
    """The announcement carries its version's manifest: the follower's refresh reads only the delta
    from the bucket. A manifest that does not match its announcement is not used."""
    trainer = _Trainer(test_cluster)
    engine = SimulatedEngine()
    follower = WeightFollower(test_cluster, {POLICY: engine}, "node-m", check_every_s=60)
    store = follower.subscribers[POLICY].store
    read: list[str] = []
    get_json = store.objects.get_json

    def logged_get_json(key: str, *args, **kwargs):
        read.append(key)
        return get_json(key, *args, **kwargs)

    try:
        trainer.publish(1)
        follower.catch_up(timeout_s=30)
        store.objects.get_json = logged_get_json
        follower.start()
        deadline = time.monotonic() + 60  # for both waits together
        version = _announce_until(trainer, lambda: engine.weight_version >= 2, 60, "an announced version served",
                                  on_timeout=lambda: f"not served: v{engine.weight_version}")
        wait_until(lambda: engine.weight_version >= version, max(0.0, deadline - time.monotonic()),  # the last one
                   f"v{version}, the last one announced, served", interval_s=0.01,
                   on_timeout=lambda: f"v{version} not served: v{engine.weight_version}")
        served = version
        live = _bits(engine.state_dict())
        assert all(torch.equal(live[k], trainer.truth[served][k]) for k in trainer.truth[served])
        assert store.layout.manifest_key(POLICY, served) not in read, read
    finally:
        follower.stop()
        trainer.pub.close()

    body = store.manifest(served).model_dump(mode="json")
    fields = {"policy": POLICY, "kind": "delta", "manifest": "k", "bytes": 1, "checksum": body["state_digest"]}
    for other in (WeightAnnouncement(version=99, **fields, manifest_body=body),  # v<served>'s body, not v99's
                  WeightAnnouncement(version=99, **fields, manifest_body={"policy": POLICY})):  # malformed
        assert carried_manifest(other) is None
        follower._remember_manifest(POLICY, other)
    assert 99 not in store._manifests
    own = WeightAnnouncement(version=served, **fields, manifest_body=body)
    assert carried_manifest(own) == store.manifest(served)
