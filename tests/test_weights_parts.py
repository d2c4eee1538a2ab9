"""Versions published in parts (one per rank, no gather; :mod:`astraflow.delta.parts`) on the real
bucket and broker: two gloo ranks each publish their rows; a node following the policy serves
weights bit-exact to the same versions published whole (same CRC-32C of every tensor, same state
digest); ``verify`` and the GC handle parts; a missing or corrupt part is refused by name and the node
keeps the version it has; a manifest whose parts miss rows is refused; a format-1 manifest (one
anchor / one delta, as older buckets hold) still loads."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
from fakes import FakeEngine
from process_helpers import launch_ranks
from pydantic import ValidationError
from weights_helpers import shard_rows

from astraflow.delta import NoPathError, WeightPublisher, WeightStore, WeightSubscriber
from astraflow.delta.bits import checksum, crc_concat, tensor_checksum
from astraflow.delta.manifest import Manifest
from astraflow.delta.parts import PartOf
from astraflow.delta.verify import verify_chain
from astraflow.engines import FullState, InPlacePatch
from astraflow.raas.weights import WeightFollower

pytestmark = [pytest.mark.integration]
PARTED, WHOLE = "parted", "whole"
SPARE = ("gc", "missing", "corrupt")
"""Policies published in parts like ``parted``, for the tests that delete or damage objects."""
VERSIONS = 4  # v0 anchor, v1..v3 deltas (v2 also an anchor: anchor_every=2)


def _states() -> list[dict[str, torch.Tensor]]:
    """The same versions on every process: odd row counts (parts of unequal size), a one-row tensor
    (part 1 holds none of it), a 0-dim one, and about 1% of entries changed a version."""
    gen = torch.Generator().manual_seed(11)
    state = {"embed.weight": torch.randn(37, 16, generator=gen), "layer.weight": torch.randn(20, 12, generator=gen),
             "layer.bias": torch.randn(7, generator=gen), "norm.weight": torch.randn(1, 16, generator=gen),
             "scale": torch.randn((), generator=gen)}
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    out = [state]
    for _ in range(1, VERSIONS):
        nxt = {}
        for name, t in out[-1].items():
            flat = t.clone().view(torch.int16).reshape(-1)
            pick = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
            flat[pick] += 1  # one bf16 step
            nxt[name] = flat.view(torch.bfloat16).reshape(t.shape)
        out.append(nxt)
    return out


def _publish_my_part(cfg, group: str) -> int:
    """One rank of two: publish its rows of every version (rank 0 writes the manifests and announces)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shapes = {name: list(t.shape) for name, t in _states()[0].items()}
    for policy in (PARTED, *SPARE):
        with WeightPublisher(cfg, policy, anchor_every=2, max_lag_versions=VERSIONS,
                             part=PartOf(rank, world, group)) as pub:
            for v, state in enumerate(_states()):
                views, rows = shard_rows(state, rank, world)
                pub.publish(views, v, rows=rows, shapes=shapes)
    return rank


@pytest.fixture(scope="module")
def published_run(cluster):
    """A run of this module's: the versions published in 2 parts by 2 gloo ranks (once, for every test
    here), and whole by one publisher."""
    cfg = cluster.model_copy(update={"run": f"weights-parts-{uuid.uuid4().hex[:8]}"})
    assert launch_ranks(_publish_my_part, 2, cfg, uuid.uuid4().hex[:8]) == {0: 0, 1: 1}
    with WeightPublisher(cfg, WHOLE, anchor_every=2, announce=False) as pub:
        for v, state in enumerate(_states()):
            pub.publish(state, v)
    return cfg


@pytest.fixture
def published(published_run):
    return WeightStore.from_config(published_run, PARTED), WeightStore.from_config(published_run, WHOLE)


def test_crc_of_a_concatenation_from_its_pieces():
    for a, b in [(b"", b"xyz"), (b"abc", b""), (os.urandom(1000), os.urandom(12345))]:
        assert crc_concat(checksum(a), checksum(b), len(b)) == checksum(a + b)


def _bits_equal(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want)


def test_two_ranks_publish_in_parts_and_a_node_serves_them_bit_exactly(published_run, published):
    test_cluster = published_run
    parted, whole = published
    states = _states()
    for v in range(VERSIONS):
        mp, mw = parted.manifest(v), whole.manifest(v)
        assert len(mp.parts) == 2 and len(mw.parts) == 1 and mp.format == 2
        # the whole tensors' CRC-32C, combined from the parts', are a gathered publish's: one state digest
        assert mp.tensors == mw.tensors and mp.state_digest == mw.state_digest
        assert mp.has_anchor == mw.has_anchor and mp.has_delta == mw.has_delta and mp.changed == mw.changed
    assert "scale" not in parted.manifest(1).parts[1].rows and parted.manifest(1).parts[0].rows["embed.weight"] == (0, 19)
    # a node following the policy: the v2 anchor's parts put together, then v3's delta parts
    engine = FakeEngine(accepts=frozenset({FullState, InPlacePatch}))
    follower = WeightFollower(test_cluster, {PARTED: engine}, "node-parts", check_every_s=0.2)
    try:
        assert follower.catch_up(timeout_s=60) == {PARTED: VERSIONS - 1}
        assert _bits_equal(engine.state_dict(), states[-1])
        assert {n: tensor_checksum(t) for n, t in engine.state_dict().items()} == whole.manifest(VERSIONS - 1).tensors
    finally:
        follower.stop()
    # a serving engine's in-place patch: v1's parts decoded beside it, then written (the pause)
    sub = WeightSubscriber(test_cluster, PARTED, "patcher", register=False)
    live = {k: v.clone() for k, v in sub.pull(0)[0].items()}
    patch = sub.prepare_patch(live, 1)
    assert patch is not None and patch.version == 1
    patch.write(live)
    assert patch.verify(live) == [] and _bits_equal(live, states[1])
    # a fresh subscriber pulls every version (anchor parts + delta parts), and verify walks the chain
    sub = WeightSubscriber(test_cluster, PARTED, "puller", register=False)
    for v in range(VERSIONS):
        state, version, _ = sub.pull(v)
        assert version == v and _bits_equal(state, states[v])
    checks = verify_chain(parted)
    assert [c.ok for c in checks] == [True] * VERSIONS, checks
    assert "2 parts" in checks[1].detail


def test_the_weights_cli_lists_shows_and_verifies_versions_in_parts(published_run, tmp_path, capsys):
    import yaml

    from astraflow.cli.main import main as cli

    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(published_run.model_dump(mode="json", exclude={"run", "state_dir"})))
    args, common = ["--config", str(config), "weights"], ["--run", published_run.run, "--policy", PARTED]
    assert cli([*args, "ls", *common]) == 0
    assert cli([*args, "show", *common, "3"]) == 0
    assert "parts" in capsys.readouterr().out
    assert cli([*args, "show", *common, "3", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [p["delta"]["key"].rsplit("/", 1)[1] for p in shown["parts"]] == ["delta.part-0-of-2.zst",
                                                                           "delta.part-1-of-2.zst"]
    assert cli([*args, "verify", *common]) == 0
    assert f"{VERSIONS} versions, 0 failed" in capsys.readouterr().out


def test_gc_deletes_every_part_of_a_collected_version(published_run):
    from astraflow.delta import RetentionPolicy

    test_cluster = published_run
    parted = WeightStore.from_config(test_cluster, "gc")
    plan = parted.gc(RetentionPolicy(keep_versions=1))
    assert plan.delete == [0, 1] and parted.versions() == [2, 3]
    for v in (0, 1):
        assert list(parted.objects.list(parted.layout.version_prefix("gc", v))) == []
    assert len(list(parted.objects.list(parted.layout.version_prefix("gc", 2)))) == 7  # 2 anchor, 2 delta parts, 2 records, manifest
    state, version, _ = WeightSubscriber(test_cluster, "gc", "after-gc", register=False).pull()
    assert version == 3 and _bits_equal(state, _states()[3])


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_part_is_refused_by_name_and_the_node_keeps_its_version(published_run, damage):
    test_cluster = published_run
    parted = WeightStore.from_config(test_cluster, damage)
    states = _states()
    sub = WeightSubscriber(test_cluster, damage, f"node-{damage}", register=False)
    sub.pull(1)
    bad = parted.manifest(3).parts[1].delta.key
    if damage == "missing":
        parted.objects.delete(bad)
    else:
        blob = bytearray(parted.objects.get_bytes(bad))
        blob[len(blob) // 2] ^= 0x10
        parted.objects.put_bytes(bad, bytes(blob))  # a consistent object, not the one its manifest names
    with pytest.raises(NoPathError) as err:  # the v2 anchor is no way round: v3 has no anchor
        sub.pull(3)
    why = str(err.value.__cause__)
    assert bad in why and ("is missing from the bucket" if damage == "missing" else "sha256") in why, why
    assert list(sub.refused) == [bad]  # the part named, not the other part
    assert sub.version == 2 and _bits_equal(sub.pull(2)[0], states[2])  # v2 applied, v3 refused: it holds v2
    # a serving node's patch path refuses it as well and keeps its weights
    node = WeightSubscriber(test_cluster, damage, f"patcher-{damage}", register=False)
    live = {k: v.clone() for k, v in node.pull(2)[0].items()}
    assert node.prepare_patch(live, 3) is None and list(node.refused) == [bad]
    assert node.version == 2 and _bits_equal(live, states[2])


def test_a_manifest_whose_parts_miss_rows_is_refused(published):
    parted, _ = published
    raw = parted.manifest(1).model_dump(mode="json")
    raw["parts"][1]["rows"]["embed.weight"] = [20, 37]  # row 19 is in no part
    with pytest.raises(ValidationError, match="do not cover its 37 rows"):
        Manifest.model_validate(raw)
    raw = parted.manifest(1).model_dump(mode="json")
    del raw["parts"][1]
    with pytest.raises(ValidationError, match="do not cover"):
        Manifest.model_validate(raw)


def test_a_format_1_manifest_loads_as_one_part(published_run, published):
    """What older versions hold: ``anchor`` / ``delta`` at the top, no parts, no shapes."""
    test_cluster = published_run
    _, whole = published
    objects, layout = whole.objects, whole.layout
    for v in range(VERSIONS):
        raw = whole.manifest(v).model_dump(mode="json")
        [part] = raw.pop("parts")
        raw.pop("shapes")
        raw.update(format=1, policy="old", anchor=part["anchor"], delta=part["delta"])
        objects.put_json(layout.manifest_key("old", v), raw)
    old = WeightStore.from_config(test_cluster, "old")
    assert old.manifest(3).format == 1 and len(old.manifest(3).parts) == 1
    state, version, _ = WeightSubscriber(test_cluster, "old", "reader", register=False).pull(3)
    assert version == 3 and _bits_equal(state, _states()[3])
    assert all(c.ok for c in verify_chain(old))
