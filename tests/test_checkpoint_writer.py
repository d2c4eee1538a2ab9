"""Checkpoints saved off the training loop: commits wait for a durable save, one save at a time, in
order, and a failed save surfaces in the loop. (The trainer's kill/restart on the real stack is in
test_trainer_service.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from astraflow.trainer.checkpoint import TrainerCheckpoint
from astraflow.trainer.checkpoint_writer import CheckpointWriter


def _ckpt(step: int) -> TrainerCheckpoint:
    return TrainerCheckpoint(step=step, version=step, model_state={}, optimizer_state=None)


class _GatedSaves:
    """A save that blocks until the test opens its gate, recording what was saved."""

    def __init__(self) -> None:
        self.saved: list[tuple[int, list[str]]] = []
        self.started = threading.Event()
        self.gate = threading.Event()

    def __call__(self, ckpt: TrainerCheckpoint) -> None:
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.saved.append((ckpt.step, list(ckpt.batch_ids)))


def test_a_save_in_flight_is_collected_only_once_durable():
    saves = _GatedSaves()
    writer: CheckpointWriter[list[str]] = CheckpointWriter(saves)
    writer.start(_ckpt(2), ["b1", "b2"])
    assert saves.started.wait(5)
    assert writer.collect() is None and writer.busy  # still uploading: nothing to commit yet
    with pytest.raises(RuntimeError, match="in flight"):
        writer.start(_ckpt(4), ["b3"])  # one save at a time
    saves.gate.set()
    saved = writer.collect(wait=True)
    assert (saved.checkpoint.step, saved.covered, saves.saved) == (2, ["b1", "b2"], [(2, [])])
    assert saved.save_s > 0 and not writer.busy and writer.collect(wait=True) is None


def test_a_failed_save_raises_in_the_loop():
    def broken(ckpt: TrainerCheckpoint) -> None:
        raise OSError("bucket refused the pointer")

    writer: CheckpointWriter[list[str]] = CheckpointWriter(broken)
    writer.start(_ckpt(2), ["b1"])
    with pytest.raises(OSError, match="refused the pointer"):
        writer.collect(wait=True)
    assert not writer.busy  # the next checkpoint may be tried


class _Backend:
    def state_dict(self) -> dict:
        return {}

    def optimizer_state_dict(self) -> dict:
        return {}

    def sharded_state(self) -> None:  # no DCP state: the trainer writes a format-2 checkpoint
        return None


class _Consumer:
    def __init__(self) -> None:
        self.commits: list[list[str]] = []

    def commit(self, msgs: list[str]) -> None:
        self.commits.append(list(msgs))


class _Publisher:
    """No version published: a checkpoint finds no step record to wait for."""

    def published_after(self, seen: int) -> tuple[list, int]:
        return [], seen

    def flush(self) -> None:
        pass


class _Records:
    def settle(self, timeout_s: float) -> bool:
        return True  # every record acknowledged


def _trainer(saves) -> object:
    """The trainer service's checkpoint path with a stand-in backend, publisher, records and save (no
    broker, no bucket)."""
    from raas_support import make_recipe

    from astraflow.trainer.parts import TrainerParts
    from astraflow.trainer.service import TrainerService

    parts = TrainerParts(life="ckpt", topic_ids={}, checkpoints=None,
                         checkpoint_writer=CheckpointWriter(saves), backend=_Backend(),
                         publisher=_Publisher(), records=_Records())
    return TrainerService(None, make_recipe("ckpt"), "policy", parts, threading.Event())


def test_the_trainer_commits_a_checkpoints_batches_only_after_it_is_saved_and_trains_meanwhile():
    saves = _GatedSaves()
    svc = _trainer(saves)
    consumer = _Consumer()
    svc.step, svc.batch_ids, svc._uncommitted = 2, ["b1", "b2"], ["m1", "m2"]
    svc._checkpoint(consumer)  # returns while the save blocks
    assert saves.started.wait(5)
    # the loop trains on: later batches are not covered by the checkpoint in flight
    svc.step, svc._uncommitted = 3, ["m3"]
    svc.batch_ids.append("b3")
    svc._commit_saved(consumer)
    assert consumer.commits == []  # not durable yet: nothing committed
    saves.gate.set()
    deadline = time.monotonic() + 5
    while not consumer.commits and time.monotonic() < deadline:
        svc._commit_saved(consumer)  # what the loop does after each poll
        time.sleep(0.01)
    # the snapshot kept the batch ids of step 2, not the list the loop went on appending to
    assert consumer.commits == [["m1", "m2"]] and saves.saved == [(2, ["b1", "b2"])]
    assert svc._uncommitted == ["m3"]
    svc._checkpoint(consumer, wait=True)  # a clean stop: saved and committed before it returns
    assert consumer.commits == [["m1", "m2"], ["m3"]]
    assert saves.saved == [(2, ["b1", "b2"]), (3, ["b1", "b2", "b3"])]


def test_a_checkpoint_due_while_the_last_one_uploads_waits_for_it():
    saved_ids: list[list[str]] = []
    release = threading.Event()

    def slow_save(ckpt: TrainerCheckpoint) -> None:
        release.wait(10)
        saved_ids.append(list(ckpt.batch_ids))

    svc = _trainer(slow_save)
    consumer = _Consumer()
    svc.step, svc.batch_ids, svc._uncommitted = 1, ["b1"], ["m1"]
    svc._checkpoint(consumer)
    svc.step, svc._uncommitted = 2, ["m2"]
    svc.batch_ids.append("b2")
    threading.Timer(0.2, release.set).start()
    svc._checkpoint(consumer)  # waits for step 1's save, commits it, then starts step 2's
    assert consumer.commits[:1] == [["m1"]]
    svc._checkpoint(consumer, wait=True)
    assert consumer.commits == [["m1"], ["m2"]] and saved_ids == [["b1"], ["b1", "b2"]]
