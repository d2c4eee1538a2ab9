"""Every step the trainer takes gets its step record once its version is published, however the
publisher's thread interleaves with the loop (no broker, no bucket: the trainer's own bookkeeping)."""

from __future__ import annotations

import threading
from types import SimpleNamespace


class _PublishedMeanwhile(list):
    """The publisher's ``published`` list, whose thread appends the next version right after the
    trainer has read it: the interleaving that lost step 19's record in a CI run."""

    def __init__(self, late: list) -> None:
        super().__init__()
        self.late = late

    def __getitem__(self, index):
        taken = super().__getitem__(index)
        if isinstance(index, slice) and self.late:
            self.append(self.late.pop(0))
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

    published = _PublishedMeanwhile(late=[_manifest(2), _manifest(3)])
    published.append(_manifest(1))
    publisher = SimpleNamespace(published=published, announced_at={}, gc_totals={"versions": 0})
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
