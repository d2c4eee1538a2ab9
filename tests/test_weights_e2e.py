"""End to end on the real embedded S3 + broker: a publisher writes 31 versions (0..30) of a
changing model; subscribers starting at 0, 29 and nothing reach 30 bit-exact; corruption is
refused; manifests are immutable; GC keeps what the retention rule says; the CLI reads it all."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import yaml

from astraflow.cli.main import main as cli
from astraflow.delta import (
    DeltaCorruptError,
    NoPathError,
    RetentionPolicy,
    VersionExistsError,
    WeightPublisher,
    WeightStore,
    WeightSubscriber,
)
from astraflow.delta.verify import verify_chain

pytestmark = [pytest.mark.integration, pytest.mark.slow]
POLICY = "pi"
LAST = 30


class TiedLM(torch.nn.Module):
    """Embedding tied to the output head (one storage under two names), as in many LMs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        self.proj = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight


def make_model(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    model = TiedLM().to(torch.bfloat16)
    model.norm.float()  # mixed dtypes: fp32 norm next to bf16 weights
    return model


def optimizer_like_step(model: torch.nn.Module, rng: np.random.Generator) -> None:
    """Move ~1.5% of each tensor's elements by one ulp, like an RL step in bf16."""
    with torch.no_grad():
        for p in model.parameters():
            bits = p.view(torch.int16 if p.element_size() == 2 else torch.int32).reshape(-1)
            hit = torch.from_numpy(rng.random(bits.numel()) < 0.015)
            step = torch.from_numpy(rng.choice([-1, 1], bits.numel())).to(bits.dtype)
            bits[hit] += step[hit]


def snapshot(sd) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


def assert_bits_equal(got, want) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        iv = {2: torch.int16, 4: torch.int32}[w.element_size()]
        assert torch.equal(g.contiguous().view(iv), w.contiguous().view(iv)), k


@pytest.fixture
def published(test_cluster):
    """Versions 0..30 published with an anchor every 8; returns (cfg, truth by version)."""
    model = make_model()
    rng = np.random.default_rng(0)
    truth = {}
    with WeightPublisher(test_cluster, POLICY, anchor_every=8, max_lag_versions=2) as pub:
        for v in range(LAST + 1):
            if v:
                optimizer_like_step(model, rng)
            truth[v] = snapshot(model.state_dict())
            pub.publish(model.state_dict(), v)
        pub.flush()
        kinds = [m.kind for m in pub.published]
    assert kinds == ["anchor" if v % 8 == 0 else "delta" for v in range(LAST + 1)]
    return test_cluster, truth


def test_subscribers_reach_latest_bit_exact(published):
    cfg, truth = published
    store = WeightStore.from_config(cfg, POLICY)
    assert store.versions() == list(range(LAST + 1))
    m = store.manifest(17)
    assert m.kind == "delta" and m.base == 16 and 0.95 < m.sparsity < 0.995
    assert m.delta_bytes < 0.05 * m.full_bytes

    pulled = {}
    for start in (0, 29, None):
        sub = WeightSubscriber(cfg, POLICY, f"sub-{start}")
        if start is not None:
            state, v, _ = sub.pull(start)
            assert v == start
            assert_bits_equal(state, truth[start])
        assert sub.latest_version() == LAST
        state, v, nbytes = sub.pull()
        assert v == LAST
        assert_bits_equal(state, truth[LAST])
        pulled[start] = nbytes
        sub.close()
    print("bytes pulled to reach v30:", pulled)
    one_delta = store.manifest(LAST).delta_bytes
    assert pulled[29] == one_delta
    assert pulled[29] * 10 < pulled[None]
    # From v0 the planner takes the chain or anchor 24 + 6 deltas, whichever is fewer bytes.
    assert pulled[0] <= pulled[None]
    assert pulled[None] == store.plan(None, LAST).bytes


def test_apply_to_model_in_place_with_tied_weights(published):
    cfg, truth = published
    model = make_model(seed=123)  # different weights: the first apply_to loads an anchor
    embed = model.embed.weight
    with WeightSubscriber(cfg, POLICY, "model-sub") as sub:
        v, first = sub.apply_to(model, 20)
        assert v == 20
        assert_bits_equal(model.state_dict(), truth[20])
        v, nbytes = sub.apply_to(model)
        assert v == LAST
        assert_bits_equal(model.state_dict(), truth[LAST])
        assert model.embed.weight is embed and model.head.weight is embed  # in place, still tied
        assert nbytes < first
        # Someone changes the model behind the subscriber's back: the delta refuses the base and
        # the subscriber resyncs from an anchor instead of producing wrong weights.
        with torch.no_grad():
            model.proj.weight.view(torch.int16)[0, 0] ^= 1
        sub.version = 29  # pretend the model is at 29
        v, _ = sub.apply_to(model)
        assert_bits_equal(model.state_dict(), truth[LAST])


def test_prepare_write_patches_an_engines_tensors_bit_exact(published):
    """The engine-side split of a refresh: decode off to the side (nothing written), write the changed
    entries only (tied weights once), verify after; the subscriber keeps no copy of its own."""
    cfg, truth = published
    model = make_model(seed=123)
    with WeightSubscriber(cfg, POLICY, "patch-sub") as sub:
        sub.apply_to(model, 17)
        live = model.state_dict()
        before = snapshot(live)
        patch = sub.prepare_patch(live, 23)  # 17 -> 23: six deltas, no anchor (the next is 24)
        assert patch is not None and (patch.base_version, patch.version) == (17, 23) and patch.changed == sorted(live)
        assert_bits_equal(model.state_dict(), before)  # preparing wrote nothing
        assert sub.version == 17
        patch.write(live, threads=2)
        sub.patched(patch)
        assert sub.version == 23 and patch.verify(live) == []
        assert_bits_equal(model.state_dict(), truth[23])
        assert model.head.weight is model.embed.weight  # still tied, and written once
        assert sub.prepare_patch(model.state_dict(), 23) is None  # nothing to do
    with WeightSubscriber(cfg, POLICY, "patch-fresh") as fresh:
        assert fresh.prepare_patch(model.state_dict(), 23) is None  # holds no version: a full load
    with WeightSubscriber(cfg, POLICY, "patch-sub-2") as sub:
        # Bits changed behind the subscriber's back are caught by verify (then: a full load).
        sub.apply_to(model, 25)
        live = model.state_dict()
        with torch.no_grad():
            model.proj.weight.view(torch.int16)[0, 0] ^= 1
        patch = sub.prepare_patch(live, 27)
        patch.write(live)
        assert patch.verify(live) == ["proj.weight"]


def test_a_corrupt_delta_is_refused_before_any_write(published):
    cfg, truth = published
    store = WeightStore.from_config(cfg, POLICY)
    model = make_model(seed=1)
    with WeightSubscriber(cfg, POLICY, "patch-victim") as sub:
        sub.apply_to(model, 8)
        key = store.manifest(9).parts[0].delta.key
        blob = bytearray(store.objects.get_bytes(key))
        blob[len(blob) // 2] ^= 0x40
        store.objects.put_bytes(key, bytes(blob))
        assert sub.prepare_patch(model.state_dict(), 10) is None
        assert sub.refused == {key: "corrupt"} and sub.version == 8
        assert_bits_equal(model.state_dict(), truth[8])


def test_announcements_on_the_log(published):
    from astraflow.log import LogConsumer, Topics

    cfg, _ = published
    consumer = LogConsumer(cfg, Topics(cfg.run).weights(POLICY), f"{cfg.run}-reader")
    got = []
    deadline = time.monotonic() + 30
    while len(got) < LAST + 1 and time.monotonic() < deadline:
        got += consumer.poll(1.0)
    consumer.close()
    assert [int(m.key) for m in got] == list(range(LAST + 1))
    last = got[-1].obj
    store = WeightStore.from_config(cfg, POLICY)
    assert last["version"] == LAST and last["checksum"] == store.manifest(LAST).state_digest
    assert last["manifest"] == store.layout.manifest_key(POLICY, LAST)
    assert last["bytes"] == store.manifest(LAST).bytes
    with WeightSubscriber(cfg, POLICY, "waiter") as sub:
        assert sub.latest_version() == LAST


def test_corrupted_delta_is_refused_and_state_kept(published):
    cfg, truth = published
    store = WeightStore.from_config(cfg, POLICY)
    sub = WeightSubscriber(cfg, POLICY, "victim")
    state, _, _ = sub.pull(29)
    key = store.manifest(LAST).parts[0].delta.key
    blob = bytearray(store.objects.get_bytes(key))
    blob[len(blob) // 2] ^= 0x40
    store.objects.put_bytes(key, bytes(blob))  # a consistent object, not the one the manifest names
    with pytest.raises(NoPathError) as info:  # refused, and no other path reaches v30
        sub.pull(LAST)
    assert isinstance(info.value.__cause__, DeltaCorruptError)
    assert sub.refused == {key: "corrupt"}
    assert sub.version == 29
    assert_bits_equal(state, truth[29])
    # The codec's own checksums refuse it too, independent of the manifest's sha256.
    from astraflow.delta import DeltaError, apply

    with pytest.raises(DeltaError):
        apply(snapshot(truth[29]), bytes(blob), base_version=29)
    results = {r.version: r for r in verify_chain(store)}
    assert results[LAST].ok is False and all(results[v].ok for v in range(LAST))


def test_manifest_cannot_be_overwritten(published):
    cfg, _ = published
    store = WeightStore.from_config(cfg, POLICY)
    m = store.manifest(5)
    store.publish(m)  # the identical manifest again: a harmless retry
    with pytest.raises(VersionExistsError):
        store.publish(m.model_copy(update={"state_digest": "0" * 64}))
    assert store.manifest(5) == m
    fresh = WeightStore.from_config(cfg, POLICY)
    assert fresh.manifest(5).state_digest == m.state_digest


def test_gc_keeps_latest_anchor_recent_and_live_chains(published, tmp_path):
    cfg, truth = published
    store = WeightStore.from_config(cfg, POLICY)
    slow = WeightSubscriber(cfg, POLICY, "slow")
    slow.pull(20)  # registers at v20 with a fresh heartbeat
    store.register_subscriber("dead", 3, now=time.time() - 3600)
    # An upload above the latest version may be in flight (no manifest yet): GC must not touch it.
    in_flight = store.layout.delta_key(POLICY, LAST + 1)
    store.objects.put_bytes(in_flight, b"uploading")

    policy = RetentionPolicy(keep_versions=2, subscriber_ttl_s=60)
    dry = store.gc(policy, dry_run=True)
    assert sorted(dry.keep) == list(range(21, LAST + 1))  # live chain 21..30 covers anchor 24..30
    assert store.versions() == list(range(LAST + 1))  # dry run deletes nothing

    plan = store.gc(policy)
    assert plan.delete == list(range(21)) and [s.id for s in plan.expired] == ["dead"]
    assert store.versions() == list(range(21, LAST + 1))
    left = list(store.objects.list(store.prefix))
    assert not any(f"/v{v:08d}/" in k for k in left for v in range(21))
    assert not any(k.endswith("/dead.json") for k in left)
    assert in_flight in left and plan.orphans == []

    # Everyone still gets there: the slow one by its chain, a new one from anchor 24.
    state, v, nbytes = slow.pull()
    assert v == LAST and nbytes == sum(store.manifest(u).delta_bytes for u in range(21, LAST + 1))
    assert_bits_equal(state, truth[LAST])
    new, v, _ = WeightSubscriber(cfg, POLICY, "new").pull()
    assert_bits_equal(new, truth[LAST])

    # Once the slow subscriber is at 30, a GC drops its old chain, keeping anchor 24 and after.
    assert sorted(store.gc(policy).keep) == list(range(24, LAST + 1))

    # The CLI sees the same store.
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"run", "state_dir"})))
    args = ["--config", str(config), "weights"]
    common = ["--run", cfg.run, "--policy", POLICY]
    assert cli([*args, "ls", *common]) == 0
    assert cli([*args, "show", *common, "27"]) == 0
    assert cli([*args, "verify", *common]) == 0
    assert cli([*args, "gc", *common, "--dry-run"]) == 0


def test_publisher_error_reaches_the_caller(published):
    """A background failure (here: republishing a published version with other weights) is raised
    to the trainer, and the objects of the published version are left alone."""
    from astraflow.delta import PublisherError

    cfg, truth = published
    store = WeightStore.from_config(cfg, POLICY)
    before = store.manifest(LAST)
    pub = WeightPublisher(cfg, POLICY, announce=False)
    pub.publish(make_model(seed=9).state_dict(), LAST)
    with pytest.raises(PublisherError) as err:
        pub.close()
    assert isinstance(err.value.__cause__, VersionExistsError)
    with WeightSubscriber(cfg, POLICY, "after") as sub:
        state, _, _ = sub.pull()
    assert_bits_equal(state, truth[LAST])
    assert WeightStore.from_config(cfg, POLICY).manifest(LAST) == before


def test_publish_blocks_only_beyond_max_lag(test_cluster):
    import threading

    store = WeightStore.from_config(test_cluster, POLICY)
    gate = threading.Event()
    real_publish = store.publish
    store.publish = lambda m: (gate.wait(30), real_publish(m))[1]  # hold uploads at the manifest
    pub = WeightPublisher(test_cluster, POLICY, store=store, max_lag_versions=2, announce=False)
    model = make_model()
    rng = np.random.default_rng(1)
    t0 = time.monotonic()
    for v in range(3):  # one in flight + two queued: none of these blocks
        optimizer_like_step(model, rng)
        pub.publish(model.state_dict(), v)
    assert time.monotonic() - t0 < 10
    done = threading.Event()
    blocked = threading.Thread(target=lambda: (pub.publish(model.state_dict(), 3), done.set()))
    blocked.start()
    assert not done.wait(1.0)  # a fourth pending version waits for the upload thread
    gate.set()
    assert done.wait(30)
    blocked.join()
    pub.close()
    assert store.versions() == [0, 1, 2, 3]


def test_a_subscriber_rewrites_its_record_at_most_every_record_every_s(published):
    """A node refreshing every step writes its GC record every ``record_every_s``, not per version; the
    lagging record makes the GC keep more, and the subscriber still gets to the latest version."""
    cfg, truth = published
    store = WeightStore.from_config(cfg, POLICY)
    now = [0.0]
    sub = WeightSubscriber(cfg, POLICY, "throttled", record_every_s=10.0, clock=lambda: now[0])

    def recorded() -> int | None:
        return {s.id: s.version for s in store.subscribers()}.get("throttled")

    sub.pull(3)
    assert recorded() == 3  # the first one at once
    now[0] = 9.9
    sub.pull(6)
    sub.heartbeat()
    assert sub.version == 6 and recorded() == 3  # behind by less than 10 s: not rewritten
    plan = store.gc(RetentionPolicy(keep_versions=2, subscriber_ttl_s=60), dry_run=True)
    assert set(range(4, LAST + 1)) <= set(plan.keep)  # kept from the record's version on: more, not less
    now[0] = 10.0
    sub.heartbeat()
    assert recorded() == 6
    state, v, _ = sub.pull()
    assert v == LAST and recorded() == 6  # 10 s not passed again (deltas only, a short load: no load record)
    assert_bits_equal(state, truth[LAST])
    every = WeightSubscriber(cfg, POLICY, "every")  # the default: a record at each new version
    every.pull(5)
    every.pull(7)
    assert {s.id: s.version for s in store.subscribers()}["every"] == 7


def test_a_long_load_keeps_its_record_fresh_so_the_gc_keeps_what_it_reads(published):
    """A subscriber loads v20 (anchor v16 and four deltas) for longer than the GC's subscriber TTL: its
    record, rewritten while it loads, names the first version it reads, so a GC in the middle of the load
    (latest anchor v24, keep 2) keeps v16 on instead of deleting the versions under the reader; once loaded,
    the record names the version held and no load."""
    cfg, truth = published
    store = WeightStore.from_config(cfg, POLICY)
    sub = WeightSubscriber(cfg, POLICY, "loader", load_heartbeat_s=0.1)
    reading, release = threading.Event(), threading.Event()
    get_delta = sub.store.get_delta

    def slow_delta(version: int) -> bytes:  # a long load: the first delta waits for the test
        reading.set()
        release.wait(30)
        return get_delta(version)

    sub.store.get_delta = slow_delta
    pulled: list = []
    loader = threading.Thread(target=lambda: pulled.append(sub.pull(20)))
    loader.start()
    try:
        assert reading.wait(30)
        began = time.time()
        time.sleep(1.0)  # twice the TTL below: a record written only when the load began has expired
        plan = store.gc(RetentionPolicy(keep_versions=2, subscriber_ttl_s=0.5))
    finally:
        release.set()
        loader.join(30)
    (record,) = [r for r in plan.live if r.id == "loader"]
    assert record.loading == 16 and record.heartbeat > began + 0.5, record  # refreshed during the load
    assert plan.keep[16] == "being loaded by live subscriber loader (from v16)" and plan.delete == list(range(16))
    state, version, _ = pulled[0]
    assert version == 20
    assert_bits_equal(state, truth[20])
    after = {r.id: r for r in store.subscribers()}["loader"]
    assert (after.version, after.loading) == (20, None)


def test_snapshot_buffers_are_reused_only_once_no_encode_reads_them(test_cluster, monkeypatch):
    """The publisher copies each version into the buffers of a retired snapshot: while versions queue up
    behind a slow upload, every encode still reads its own base's and target's bits, the buffers are
    reused (fewer distinct buffers than versions), and every version is published bit-exact."""
    from astraflow.delta import publisher as publisher_module

    truth, seen, handed = {}, [], []
    real_encode = publisher_module.encode

    def checked_encode(old, new, **kw):
        time.sleep(0.05)  # a slow encode: the caller snapshots the next versions meanwhile
        assert_bits_equal(old, truth[kw["base_version"]])
        assert_bits_equal(new, truth[kw["target_version"]])
        seen.append(kw["target_version"])
        handed.append(new["embed.weight"])  # held: a tensor object seen twice is a reused buffer
        return real_encode(old, new, **kw)

    monkeypatch.setattr(publisher_module, "encode", checked_encode)
    store = WeightStore.from_config(test_cluster, POLICY)
    gate = threading.Event()
    real_publish = store.publish
    store.publish = lambda m: (gate.wait(30), real_publish(m))[1]
    model, rng, last = make_model(), np.random.default_rng(2), 12
    with WeightPublisher(test_cluster, POLICY, store=store, max_lag_versions=2, announce=False) as pub:
        for v in range(last + 1):
            if v:
                optimizer_like_step(model, rng)
            truth[v] = snapshot(model.state_dict())
            pub.publish(model.state_dict(), v)
            if v == 2:
                gate.set()  # v0 held at its upload, v1 and v2 queued; the rest flow
        pub.flush()
    assert seen == list(range(1, last + 1))
    distinct = len({id(t) for t in handed})
    assert distinct <= last // 2  # reused (a base, one being encoded, queued ones), not one per version
    with WeightSubscriber(test_cluster, POLICY, "reuse") as sub:
        for v in (5, last):
            state, _, _ = sub.pull(v)
            assert_bits_equal(state, truth[v])
