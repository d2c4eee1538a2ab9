"""Corrupt weight objects on a live run (real embedded S3 + broker): a RaaS node's weight follower
refuses them with a counted reason, keeps serving the newest good version, never raises, and
reaches the next version it can (the next anchor, or an older anchor when an anchor is corrupt)."""

from __future__ import annotations

import time

import pytest
import torch
from fakes import FakeEngine
from waiting import wait_until

from astraflow.delta import NoPathError, WeightPublisher, WeightStore, WeightSubscriber
from astraflow.engines import FullState
from astraflow.raas.weights import WeightFollower

pytestmark = [pytest.mark.integration]
POLICY = "pi"


def bits(sd) -> dict:
    return {k: v.contiguous().view(torch.int16 if v.element_size() == 2 else torch.int32).clone()
            for k, v in sd.items()}


def assert_bits_equal(got, want) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(bits(got)[k], want[k]), k


def flip(store: WeightStore, key: str, *, keep_metadata: bool) -> None:
    """Overwrite ``key`` with one bit flipped. ``keep_metadata``: the object still claims the old
    sha256 (the objstore's read check refuses it); otherwise a consistent object that is not the
    one its manifest names (the weight store's check refuses it)."""
    blob = bytearray(store.objects.get_bytes(key))
    old = store.objects.head(key)["sha256"] if keep_metadata else None
    blob[len(blob) // 2] ^= 0x10
    store.objects.put_bytes(key, bytes(blob), sha256=old)


def test_corrupt_delta_and_anchor_are_refused_counted_and_routed_around(test_cluster):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)).to(torch.bfloat16)
    truth = {}
    store = WeightStore.from_config(test_cluster, POLICY)
    pub = WeightPublisher(test_cluster, POLICY, anchor_every=4, max_lag_versions=8)

    def publish(upto: int) -> None:
        for v in range(len(truth), upto + 1):
            if v:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.01)
            truth[v] = bits(model.state_dict())
            pub.publish(model.state_dict(), v)
        pub.flush()

    engine = FakeEngine(accepts=frozenset({FullState}))  # full loads only: test_weights_patch.py covers patches
    follower = WeightFollower(test_cluster, {POLICY: engine}, "node-a", check_every_s=0.3)
    try:
        publish(1)
        assert follower.catch_up(timeout_s=30) == {POLICY: 1}
        # v2's delta is corrupt (a consistent object, not the one its manifest names); v3 is on top.
        publish(3)
        flip(store, store.manifest(2).parts[0].delta.key, keep_metadata=False)
        assert follower.refresh(POLICY) is False  # refused, not raised
        assert engine.weight_version == 1
        assert_bits_equal(engine.state_dict(), truth[1])
        assert follower.counters == {"weights.refused.corrupt": 1, "weights.unreachable": 1}
        # Following on: v3 is retried on every check without fetching v2 again and without a crash.
        follower.start()
        time.sleep(1.5)  # deliberate: several of the follower's checks go by, each retrying v3 (and refused)
        follower.check()
        assert engine.weight_version == 1
        assert follower.counters == {"weights.refused.corrupt": 1, "weights.unreachable": 1}
        # The next anchor (v4) does not need v2: the follower takes it, bit-exact.
        publish(4)
        wait_until(lambda: engine.weight_version == 4 or (follower.check() and False), 30,
                   "the follower to reach the v4 anchor", interval_s=0.1)
        assert_bits_equal(engine.state_dict(), truth[4])
        assert follower.counters == {"weights.refused.corrupt": 1, "weights.unreachable": 1}

        # A corrupt anchor (v8: the bytes no longer match the sha256 stored with them). A node that
        # joins now falls back to the v4 anchor + deltas 5..9 in the same pull.
        publish(9)
        flip(store, store.manifest(8).parts[0].anchor.key, keep_metadata=True)
        late = FakeEngine(accepts=frozenset({FullState}))
        joiner = WeightFollower(test_cluster, {POLICY: late}, "node-b")
        try:
            assert joiner.catch_up(timeout_s=30) == {POLICY: 9}
            assert_bits_equal(late.state_dict(), truth[9])
            assert joiner.counters == {"weights.refused.checksum": 1}
        finally:
            joiner.stop()
        # The first node, on the chain, never needed the v8 anchor.
        wait_until(lambda: engine.weight_version == 9 or (follower.check() and False), 30,
                   "the follower to reach v9", interval_s=0.1)
        assert_bits_equal(engine.state_dict(), truth[9])
        follower.check()
    finally:
        follower.stop()
        pub.close()


def test_subscriber_refusal_is_the_cause_of_no_path(test_cluster):
    """Called directly, a subscriber raises NoPathError caused by the refusal, keeps its state and
    does not fetch the refused object again."""
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 16).to(torch.bfloat16)
    store = WeightStore.from_config(test_cluster, POLICY)
    with WeightPublisher(test_cluster, POLICY, anchor_every=8) as pub:
        for v in range(3):
            with torch.no_grad():
                model.weight.add_(torch.randn_like(model.weight) * 0.01)
            pub.publish(model.state_dict(), v)
        pub.flush()
    key = store.manifest(2).parts[0].delta.key
    flip(store, key, keep_metadata=True)
    sub = WeightSubscriber(test_cluster, POLICY, "victim", register=False)
    sub.pull(1)
    with pytest.raises(NoPathError) as info:
        sub.pull(2)
    assert type(info.value.__cause__).__name__ == "ChecksumError"
    assert sub.version == 1 and sub.refused == {key: "checksum"}
    pulled = sub.bytes_pulled
    with pytest.raises(NoPathError):
        sub.pull(2)
    assert sub.bytes_pulled == pulled
