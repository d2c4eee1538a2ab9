"""Every step the trainer takes gets its step record once its version is published, however the
publisher's thread interleaves with the loop (no broker, no bucket: the trainer's own bookkeeping)."""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace


class _PublisherMeanwhile:
    """A publisher's bookkeeping of what it published (:meth:`WeightPublisher.published_after` itself),
    whose thread publishes the next version right after the trainer has taken the new ones: the
    interleaving that lost step 19's record in a CI run."""

    def __init__(self, late: list) -> None:
        from astraflow.delta.publisher import MANIFESTS_KEPT

        self.published: deque = deque(maxlen=MANIFESTS_KEPT)
        self.published_total = 0
        self._published_lock = threading.Lock()
        self.late = late
        self.announced_at: dict[int, float] = {}
        self.gc_totals = {"versions": 0}

    def publish(self, manifest) -> None:  # what the publisher's thread does, under the same lock
        with self._published_lock:
            self.published.append(manifest)
            self.published_total += 1

    def published_after(self, seen: int):
        from astraflow.delta.publisher import WeightPublisher

        taken = WeightPublisher.published_after(self, seen)
        if self.late:
            self.publish(self.late.pop(0))
        return taken


class _Records:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send_json(self, topic: str, key: str, obj: dict, **headers) -> None:
        self.sent.append(obj)


def _manifest(version: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, bytes=10, kind="delta")


def test_a_version_published_while_the_trainer_reads_the_list_still_gets_its_step_record():
    from raas_support import make_recipe

    from astraflow.trainer.parts import TrainerParts
    from astraflow.trainer.service import TrainerService

    publisher = _PublisherMeanwhile(late=[_manifest(2), _manifest(3)])
    publisher.publish(_manifest(1))
    records = _Records()
    parts = TrainerParts(life="life", topic_ids={}, checkpoints=SimpleNamespace(pruned_steps=0),
                         checkpoint_writer=None, backend=None, publisher=publisher, records=records)
    svc = TrainerService(SimpleNamespace(run="steps"), make_recipe("steps"), "policy", parts, threading.Event())
    step = {"batch_id": "b", "loss": 0.0, "reward_mean": 0.0, "staleness_mean": 0.0, "staleness_max": 0,
            "wait_s": 0.0, "step_s": 0.1, "trajectories": 1, "tokens": 1, "grad_norm": 0.0, "handoff_ms": {},
            "state_copy_s": 0.0, "publish_blocked_s": 0.0}
    for version in (1, 2, 3):
        svc._pending_records[version] = ({**step, "step": version}, 0.0)
    for _ in range(3):  # one per loop turn; the publisher appends a version during each of the first two
        svc._emit_published()
    assert [r["step"] for r in records.sent] == [1, 2, 3]
    assert svc._pending_records == {}


def test_the_publisher_keeps_only_its_newest_manifests():
    """A long run publishes a version a step and the publisher keeps only the newest MANIFESTS_KEPT (its
    RSS grew ~10 MB per 1,000 steps when it kept all): a reader that keeps up still gets each one once."""
    from astraflow.delta.publisher import MANIFESTS_KEPT

    publisher = _PublisherMeanwhile(late=[])
    seen, got = 0, []
    for version in range(1, 3 * MANIFESTS_KEPT + 1):
        publisher.publish(_manifest(version))
        if version % 7 == 0:  # a reader taking them a few at a time
            fresh, seen = publisher.published_after(seen)
            got += [m.version for m in fresh]
    fresh, seen = publisher.published_after(seen)
    got += [m.version for m in fresh]
    assert got == list(range(1, 3 * MANIFESTS_KEPT + 1)) and seen == 3 * MANIFESTS_KEPT
