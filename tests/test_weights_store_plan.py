"""``WeightStore.plan`` on a real bucket: a subscriber a few versions behind reads the manifests in
between instead of listing the bucket (whose listing grows with the run), and gets the path the full
listing gives; a target too far ahead or not published is planned over the listing."""

from __future__ import annotations

import pytest
import torch

from astraflow.delta import WeightPublisher, WeightStore
from astraflow.delta.errors import VersionNotFoundError
from astraflow.delta.planner import plan_path

pytestmark = [pytest.mark.integration]
POLICY = "pi"


@pytest.fixture
def store(test_cluster):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32).to(torch.bfloat16)
    pub = WeightPublisher(test_cluster, POLICY, anchor_every=5, max_lag_versions=16)
    for v in range(13):
        with torch.no_grad():
            model.weight.view(torch.int16).reshape(-1)[v::7] += 1
        pub.publish(model.state_dict(), v)
    pub.flush()
    pub.close()
    store = WeightStore.from_config(test_cluster, POLICY)
    lists: list[str] = []
    listing = store.objects.list

    def counted_list(prefix: str, *args, **kwargs):
        lists.append(prefix)
        return listing(prefix, *args, **kwargs)

    store.objects.list = counted_list
    store.lists = lists
    return store


def _steps(plan) -> list[tuple[str, int]]:
    return [(s.kind, s.version) for s in plan.steps]


def test_a_near_plan_reads_manifests_and_lists_nothing(store):
    near = store.plan(9, 12)
    assert store.lists == []
    assert _steps(near) == [("delta", 10), ("delta", 11), ("delta", 12)]
    assert _steps(near) == _steps(plan_path(store.manifests(), 9, 12))


def test_a_refused_delta_in_between_takes_the_anchor_after_it_without_listing(store):
    avoid = {store.manifest(10).parts[0].delta.key}  # v10 is an anchor (anchor_every 5): a10 + d11 + d12
    plan = store.plan(9, 12, avoid=avoid)
    assert store.lists == []
    assert _steps(plan) == [("anchor", 10), ("delta", 11), ("delta", 12)]
    assert _steps(plan) == _steps(plan_path(store.manifests(), 9, 12, avoid))


def test_a_far_or_unpublished_target_lists(store):
    store.plan(1, 12)
    assert len(store.lists) == 1
    with pytest.raises(VersionNotFoundError):
        store.plan(11, 14)
    assert len(store.lists) == 2
