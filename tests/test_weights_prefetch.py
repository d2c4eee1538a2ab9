"""A subscriber one version behind downloads the next delta while the store reads the manifest that
names it (``WeightStore.prefetch_delta``), on a real bucket: the two reads overlap, the delta is read
once, the result is bit-exact, and the prefetched bytes are checked like any others."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from astraflow.delta import WeightPublisher, WeightStore, WeightSubscriber
from astraflow.delta.errors import DeltaCorruptError

pytestmark = [pytest.mark.integration]
POLICY = "pi"


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32).to(torch.bfloat16)
    out = []
    for v in range(n):
        with torch.no_grad():
            model.weight.view(torch.int16).reshape(-1)[v::7] += 1
        out.append({k: t.clone() for k, t in model.state_dict().items()})
    return out


def _publish(cfg, states: list[dict[str, torch.Tensor]], start: int = 0) -> None:
    pub = WeightPublisher(cfg, POLICY, anchor_every=100, max_lag_versions=16)
    if start:
        pub.assume_published(states[start - 1], start - 1)
    for v in range(start, len(states)):
        pub.publish(states[v], v)
    pub.flush()
    pub.close()


class _ReadLog:
    """Wraps a store's reads: when each read of a key started and ended; manifest reads are slowed
    down so that a delta read running beside them shows."""

    def __init__(self, store: WeightStore, manifest_delay_s: float = 0.3) -> None:
        self.events: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()
        objects = store.objects
        get_json, get_bytes = objects.get_json, objects.get_bytes_with_sha256

        def slow_get_json(key: str, *args, **kwargs):
            self._log("start", key)
            time.sleep(manifest_delay_s)  # deliberate: a slow manifest read, so that a delta read beside it shows
            try:
                return get_json(key, *args, **kwargs)
            finally:
                self._log("end", key)

        def logged_get_bytes(key: str, *args, **kwargs):
            self._log("start", key)
            try:
                return get_bytes(key, *args, **kwargs)
            finally:
                self._log("end", key)

        objects.get_json, objects.get_bytes_with_sha256 = slow_get_json, logged_get_bytes

    def _log(self, what: str, key: str) -> None:
        with self._lock:
            self.events.append((what, key, time.monotonic()))

    def at(self, what: str, key: str) -> list[float]:
        return [t for w, k, t in self.events if w == what and k == key]


def test_the_next_delta_downloads_while_its_manifest_is_read(test_cluster):
    states = _states(4)
    _publish(test_cluster, states[:3])
    sub = WeightSubscriber(test_cluster, POLICY, "sub-prefetch", register=False)
    sub.pull(2)
    _publish(test_cluster, states, start=3)  # announced now: its manifest is not in the store's cache
    reads = _ReadLog(sub.store)
    state, version, _ = sub.pull(3)

    manifest_key = sub.store.layout.manifest_key(POLICY, 3)
    delta_key = sub.store.layout.delta_key(POLICY, 3)
    assert version == 3
    assert all(torch.equal(state[k].view(torch.int16), states[3][k].view(torch.int16)) for k in states[3])
    assert len(reads.at("start", delta_key)) == 1  # the prefetched bytes were used, not read again
    assert reads.at("start", delta_key)[0] < reads.at("end", manifest_key)[0]  # beside the manifest read


def test_a_patch_of_the_next_version_prefetches_too(test_cluster):
    states = _states(3)
    _publish(test_cluster, states[:2])
    sub = WeightSubscriber(test_cluster, POLICY, "sub-prefetch-patch", register=False)
    live = {k: t.clone() for k, t in sub.pull(1)[0].items()}
    _publish(test_cluster, states, start=2)
    reads = _ReadLog(sub.store)
    patch = sub.prepare_patch(live, 2)
    patch.write(live)
    sub.patched(patch)

    delta_key = sub.store.layout.delta_key(POLICY, 2)
    assert len(reads.at("start", delta_key)) == 1
    assert reads.at("start", delta_key)[0] < reads.at("end", sub.store.layout.manifest_key(POLICY, 2))[0]
    assert not patch.verify(live)
    assert all(torch.equal(live[k].view(torch.int16), states[2][k].view(torch.int16)) for k in states[2])


def test_prefetched_bytes_that_are_not_the_manifests_delta_are_refused(test_cluster):
    states = _states(3)
    _publish(test_cluster, states)
    store = WeightStore.from_config(test_cluster, POLICY)
    key = store.layout.delta_key(POLICY, 2)
    store.objects.put_bytes(key, store.objects.get_bytes(key)[:-1] + b"\0")  # a valid object, other bytes
    store.prefetch_delta(2)
    with pytest.raises(DeltaCorruptError):
        store.get_delta(2)


def test_a_prefetch_that_finds_nothing_leaves_the_read_to_get_delta(test_cluster):
    states = _states(3)
    _publish(test_cluster, states[:2])
    store = WeightStore.from_config(test_cluster, POLICY)
    store.prefetch_delta(2)  # v2 is not uploaded yet: this read fails
    store._prefetched[2].exception(timeout=10)
    _publish(test_cluster, states, start=2)
    [(rows, blob)] = store.get_delta(2)  # one part: the whole state
    assert rows is None and blob == store.objects.get_bytes(store.layout.delta_key(POLICY, 2))
