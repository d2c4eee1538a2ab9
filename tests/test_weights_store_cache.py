"""A weight store keeps only the newest manifests in memory: a publisher's store cached every version
it wrote, and a trainer's RSS grew with the run (~10 KB a step, benchmarks/long_run.py). A manifest
it has forgotten is read from the bucket again."""

from __future__ import annotations

import pytest
import torch

from astraflow.delta import WeightPublisher
from astraflow.delta import store as store_module

pytestmark = [pytest.mark.integration]
POLICY = "pi"
KEPT = 4


def test_a_publishers_store_keeps_only_the_newest_manifests(test_cluster, monkeypatch):
    monkeypatch.setattr(store_module, "MANIFESTS_CACHED", KEPT)
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    pub = WeightPublisher(test_cluster, POLICY, anchor_every=5, max_lag_versions=4)
    try:
        for v in range(3 * KEPT):
            with torch.no_grad():
                model.weight.view(torch.int16).reshape(-1)[v::5] += 1
            pub.publish(model.state_dict(), v)
        pub.flush()
        cached = sorted(pub.store._manifests)
        assert cached == list(range(2 * KEPT, 3 * KEPT))
        oldest = pub.store.manifest(0)  # forgotten: read from the bucket again
        assert oldest.version == 0 and oldest.has_anchor
        assert sorted(pub.store._manifests) == cached  # older than every cached one: not kept
        assert pub.store.manifest(3 * KEPT - 1) is pub.store._manifests[3 * KEPT - 1]
    finally:
        pub.close()
