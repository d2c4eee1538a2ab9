"""The node's trajectory outbox: the episodes that finish in one turn of the event loop share a record.

A merged generate ends many episodes at once (the demo: 16 tasks of 8 samples each). Sending their
trajectories as one Arrow record costs one table, one produce and one decode at the dataflow instead of
one of each per episode. Each episode still waits for the broker's acknowledgement of the record that
holds its trajectories before its task may be committed, so at-least-once is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from astraflow.log.producer import record_policy
from astraflow.records import trajectory as traj_rec

log = logging.getLogger(__name__)


class TrajectoryOutbox:
    """Collects ``send`` calls made in one event-loop turn and produces them as one record to ``topic``."""

    def __init__(self, producer: Any, topic: str) -> None:
        self.producer = producer
        self.topic = topic
        self._pending: list[tuple[str, list[traj_rec.Trajectory], asyncio.Future]] = []
        self.records = 0
        """Records produced (each holds one or more episodes' trajectories)."""

    async def send(self, key: str, trajectories: list[traj_rec.Trajectory]) -> None:
        """Queue one episode's trajectories; returns once the record holding them is acknowledged.
        Raises what the producer raises (``ProduceRefusedError``) and, before queueing, what
        ``Trajectory.validate`` raises, so one bad episode does not take its neighbours with it."""
        for t in trajectories:
            t.validate()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)  # after the episodes resumed in this turn have queued theirs
        self._pending.append((key, trajectories, done))
        await done

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        try:
            self._produce(pending)
        except Exception:  # find the episode it belongs to: each gets its own error
            log.warning("a record of %d episodes' trajectories could not be built; sending them one by one",
                        len(pending), exc_info=True)
            for one in pending:
                try:
                    self._produce([one])
                except Exception as exc:  # noqa: BLE001 - handed to the episode that sent it
                    _settle([one[2]], exc)

    def _produce(self, pending: list[tuple[str, list[traj_rec.Trajectory], asyncio.Future]]) -> None:
        trajectories = [t for _, ts, _ in pending for t in ts]
        ack = self.producer.send_table(self.topic, pending[0][0], traj_rec.to_table(trajectories),
                                       traj_rec.SCHEMA_NAME, traj_rec.SCHEMA_VERSION,
                                       policy=record_policy(t.policy for t in trajectories))
        self.records += 1
        waiters = [f for _, _, f in pending]
        asyncio.wrap_future(ack.as_concurrent_future()).add_done_callback(
            lambda acked: _settle(waiters, asyncio.CancelledError() if acked.cancelled() else acked.exception()))


def _settle(waiters: list[asyncio.Future], exc: BaseException | None) -> None:
    for f in waiters:
        if f.done():
            continue  # the episode was cancelled meanwhile
        if exc is None:
            f.set_result(None)
        else:
            f.set_exception(exc)
