"""Trainer checkpoints saved off the training loop: the loop snapshots, a thread uploads.

The trainer's step used to wait for every checkpoint's upload (model, optimizer, pointer: ~0.1 s for
the demo's model on the embedded S3, every ``checkpoint_every`` steps; seconds for a real model).
Now the loop hands over a snapshot (copies of the weights and the optimizer state, the offsets and
batch ids as of that step) together with what becomes safe once the snapshot is durable, and trains
on. Exactly-once training is unchanged: the batch offsets a checkpoint covers are committed only after
its pointer is written, and the commit runs on the loop's thread (the consumer is not thread-safe)
when the loop next collects finished saves. One save at a time, in order: a checkpoint that falls due
while the previous one is still uploading waits for it, so commits never overtake a durable save. A
crash mid-upload leaves the previous checkpoint in force, as a crash mid-save always did. The trainer's
save also deletes the checkpoints older than the ``trainer.keep_checkpoints`` newest (after the new
pointer is written, :class:`~astraflow.trainer.checkpoint.CheckpointStore`), on this same thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from astraflow.background_calls import BackgroundCalls
from astraflow.trainer.checkpoint import TrainerCheckpoint

Covered = TypeVar("Covered")


@dataclass
class SavedCheckpoint(Generic[Covered]):
    """A checkpoint now durable in the bucket, and what it covers (e.g. the batch records to commit)."""

    checkpoint: TrainerCheckpoint
    covered: Covered
    save_s: float
    """Seconds the upload took on the writer's thread."""


class CheckpointWriter(Generic[Covered]):
    """Runs ``save(checkpoint)`` on a background thread, one checkpoint at a time."""

    def __init__(self, save: Callable[[TrainerCheckpoint], object], name: str = "checkpoint-writer") -> None:
        self._save = save
        self._uploads = BackgroundCalls(name)
        self._in_flight: tuple[Future[float], TrainerCheckpoint, Covered] | None = None

    @property
    def busy(self) -> bool:
        """A save is in flight (or finished and not yet collected with :meth:`collect`)."""
        return self._in_flight is not None

    def start(self, checkpoint: TrainerCheckpoint, covered: Covered) -> None:
        """Start saving ``checkpoint`` (which nothing may modify from now on: pass copies). Collect any
        save in flight first (``collect(wait=True)``); starting a second one is refused."""
        if self._in_flight is not None:
            raise RuntimeError("a checkpoint save is in flight: collect it before starting the next")

        def upload() -> float:
            t0 = time.perf_counter()
            self._save(checkpoint)
            return time.perf_counter() - t0

        # A daemon thread: a trainer that dies mid-upload must not wait for it (the previous
        # checkpoint stays in force). A failed save is raised by ``collect``, in the training loop.
        done = self._uploads.submit(upload)
        self._in_flight = (done, checkpoint, covered)

    def collect(self, *, wait: bool = False) -> SavedCheckpoint[Covered] | None:
        """The save in flight once it is durable (None while it runs, unless ``wait``; None when there
        is none). A failed save raises its error here, in the training loop."""
        if self._in_flight is None:
            return None
        done, checkpoint, covered = self._in_flight
        if not wait and not done.done():
            return None
        self._in_flight = None
        return SavedCheckpoint(checkpoint, covered, done.result())
