"""The node's weight plane (real embedded S3 + broker) hands each engine the cheapest weight update
kind it accepts: a published version to an engine that fetches its weights itself, an in-place patch
after the first full load to one that takes patches, full states to any other; an engine that
accepts none of them is refused loudly, not skipped."""

from __future__ import annotations

import pytest
import torch
from fakes import FakeEngine

from astraflow.delta import WeightPublisher
from astraflow.engines import FullState, InPlacePatch, PublishedVersion, UpdateRefusedError
from astraflow.raas.weights import WeightFollower

pytestmark = [pytest.mark.integration]
ACCEPTS = {
    "full": frozenset({FullState}),
    "patch": frozenset({FullState, InPlacePatch}),
    "fetch": frozenset({FullState, PublishedVersion}),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_each_engine_gets_the_cheapest_update_kind_it_accepts(test_cluster):
    torch.manual_seed(0)
    weights = {"w": torch.randn(64, 64).to(torch.bfloat16)}  # the published dtype: patchable in place
    pubs = {p: WeightPublisher(test_cluster, p, anchor_every=100, max_lag_versions=8) for p in ACCEPTS}
    engines = {p: FakeEngine(accepts=kinds) for p, kinds in ACCEPTS.items()}
    follower = WeightFollower(test_cluster, engines, "node-k", check_every_s=60)

    def publish(version: int) -> None:
        for pub in pubs.values():
            pub.publish(weights, version)
            pub.flush()

    try:
        publish(0)
        publish(1)
        assert follower.catch_up(timeout_s=30) == dict.fromkeys(ACCEPTS, 1)
        _bits(weights["w"]).reshape(-1)[::97] += 1  # v2: a few entries one ulp up, a small delta
        publish(2)
        assert all(follower.refresh(p) for p in ACCEPTS)
        kinds = {p: [type(u) for u in e.updates] for p, e in engines.items()}
        assert kinds == {"full": [FullState, FullState], "patch": [FullState, InPlacePatch],
                         "fetch": [PublishedVersion, PublishedVersion]}
        assert engines["fetch"].updates[-1] == PublishedVersion(test_cluster, "fetch", 2, "node-k")
        assert follower.versions == dict.fromkeys(ACCEPTS, 2)
        for p in ("full", "patch"):  # the bits served are v2's, whether loaded or patched
            assert torch.equal(_bits(engines[p].state_dict()["w"]), _bits(weights["w"])), p
    finally:
        follower.stop()
        for pub in pubs.values():
            pub.close()


def test_an_engine_that_accepts_no_update_kind_is_refused(test_cluster):
    pub = WeightPublisher(test_cluster, "fixed")
    follower = WeightFollower(test_cluster, {"fixed": FakeEngine()}, "node-r", check_every_s=60)
    try:
        pub.publish({"w": torch.zeros(4, dtype=torch.bfloat16)}, 0)
        pub.flush()
        with pytest.raises(UpdateRefusedError, match="FakeEngine does not accept FullState"):
            follower.refresh("fixed")
    finally:
        follower.stop()
        pub.close()
