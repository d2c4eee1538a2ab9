"""AckFuture: the broker's acknowledgement of one sent record, read from kafka-python's own future.

``LogProducer.send_table``/``send_json`` return one per record. It answers ``done()``, ``result()``
and ``exception()`` as a ``concurrent.futures.Future`` of an :class:`~astraflow.log.message.Ack`
would, and :meth:`AckFuture.as_concurrent_future` bridges to one where a real one is needed
(``asyncio.wrap_future``).

Why not a ``concurrent.futures.Future`` per record: resolving one from kafka-python's callbacks puts a
lock, a condition and two callbacks per record on the producer's network thread, which cost ~10% of
the producer's throughput at 64 KiB records (``benchmarks/log_throughput.py``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from astraflow.log.errors import ProduceRefusedError
from astraflow.log.message import Ack


class AckFuture:
    """One record's acknowledgement (``acks="all"``): an :class:`Ack`, or :class:`ProduceRefusedError`."""

    __slots__ = ("_claim_key", "_producer_id", "_sent", "_size", "_topic")

    def __init__(self, sent: Any, producer_id: str, topic: str, size: int, claim_key: str | None) -> None:
        """``sent``: kafka-python's ``FutureRecordMetadata`` of the record; ``size``: the value's bytes
        (before a claim check replaced it with ``claim_key``)."""
        self._sent = sent
        self._producer_id = producer_id
        self._topic = topic
        self._size = size
        self._claim_key = claim_key

    def done(self) -> bool:
        """The broker acknowledged or refused the record."""
        return bool(self._sent.is_done)

    def result(self, timeout: float | None = None) -> Ack:
        """Where the record landed, waiting up to ``timeout`` seconds (None: no limit). Raises
        :class:`ProduceRefusedError` if the broker refused it, ``TimeoutError`` if it is still in flight."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        md = self._sent.value
        return Ack(md.topic, md.partition, md.offset, self._size, self._claim_key)

    def exception(self, timeout: float | None = None) -> ProduceRefusedError | None:
        """The refusal (None once acknowledged), waiting up to ``timeout`` seconds as :meth:`result` does."""
        if not self._sent.is_done:
            try:
                self._sent.get(timeout)
            except Exception:  # noqa: BLE001 - the record's own error is read from the future below
                if not self._sent.is_done:  # the wait timed out, not the record
                    raise TimeoutError(f"producer {self._producer_id}: no acknowledgement from {self._topic} "
                                       f"within {timeout} s") from None
        if self._sent.succeeded():
            return None
        error = ProduceRefusedError(
            f"producer {self._producer_id}: {self._topic} did not acknowledge: {self._sent.exception}")
        error.__cause__ = self._sent.exception
        return error

    def as_concurrent_future(self) -> Future[Ack]:
        """A ``concurrent.futures.Future`` resolved with this acknowledgement (or its refusal)."""
        bridge: Future[Ack] = Future()

        def settle(_: Any) -> None:
            error = self.exception(0)
            if error is None:
                bridge.set_result(self.result(0))
            else:
                bridge.set_exception(error)

        self._sent.add_both(settle)  # runs at once when the record is already settled
        return bridge
