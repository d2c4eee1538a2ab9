"""Request merging for engines whose ``generate`` decodes a whole batch at once (the HF engine).

A RaaS node runs many episodes concurrently and each calls ``agenerate`` with a few prompts. One
forward over all of them costs about as much as one over a few, so :class:`RequestBatcher` queues
the requests of one event-loop tick, groups them by sampling parameters and runs each group as one
``generate`` call (at most ``max_batch_size`` prompts, never splitting a request) in a worker
thread, so the event loop (Kafka I/O, other episodes) keeps running. Each caller gets exactly the
generations of its own prompts; a failed batch fails every request in it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from astraflow.engines.seeding import row_keys

if TYPE_CHECKING:
    from astraflow.engines.base import Engine, Generation, SamplingParams


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future[list[Generation]]


class RequestBatcher:
    """Merges concurrent ``submit`` calls into batched ``engine.generate`` calls.

    Bound to one event loop at a time: the queue and its worker task belong to the loop of the
    latest ``submit`` (a new loop, e.g. another ``asyncio.run``, gets a fresh queue and worker).
    """

    def __init__(self, engine: Engine, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        """Whose ``generate`` runs the merged batches (looked up per batch, so it may be replaced)."""
        self.max_batch_size = max_batch_size
        """Most prompts in one merged batch (a single larger request still runs, alone)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """The generations of ``prompts``, decoded together with the requests of other callers."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._start(loop)
        future: asyncio.Future[list[Generation]] = loop.create_future()
        self._queue.put_nowait(_Request(prompts, params, future))
        return await future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue = asyncio.Queue()
        self._worker = loop.create_task(self._drain())

    async def _drain(self) -> None:
        queue = self._queue
        while True:
            requests = [await queue.get()]
            await asyncio.sleep(0)  # let episodes that are ready in this tick enqueue too
            while not queue.empty():
                requests.append(queue.get_nowait())
            by_params: dict[SamplingParams, list[_Request]] = {}
            for r in requests:
                by_params.setdefault(r.params, []).append(r)
            for params, group in by_params.items():
                for chunk in self._chunks(group):
                    await self._run(params, chunk)

    def _chunks(self, group: list[_Request]) -> list[list[_Request]]:
        """Consecutive requests packed into chunks of at most ``max_batch_size`` prompts."""
        chunks: list[list[_Request]] = []
        size = 0
        for r in group:
            if not chunks or size + len(r.prompts) > self.max_batch_size:
                chunks.append([])
                size = 0
            chunks[-1].append(r)
            size += len(r.prompts)
        return chunks

    async def _run(self, params: SamplingParams, chunk: list[_Request]) -> None:
        merged = [p for r in chunk for p in r.prompts]
        # Each request keeps its own seed's draws in the merged batch.
        params = replace(params, seed=None,
                         row_seeds=tuple(k for r in chunk for k in row_keys(r.params, len(r.prompts))))
        try:
            gens = await asyncio.to_thread(self.engine.generate, merged, params)
        except Exception as exc:  # noqa: BLE001 - delivered to every waiting episode
            for r in chunk:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        offset = 0
        for r in chunk:
            if not r.future.done():
                r.future.set_result(gens[offset: offset + len(r.prompts)])
            offset += len(r.prompts)
