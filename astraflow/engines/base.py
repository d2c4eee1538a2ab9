"""The inference-engine contract: generate tokens with per-token behaviour log-probs and the weight
version that produced each token; swap weights between generation steps.

The contract is deliberately the one vLLM / SGLang expose (token ids in, token ids + log-probs out,
weights updated in place), so connectors for them implement the same four members.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of continuations."""

    max_new_tokens: int = 8
    """Upper bound on generated tokens per prompt (finish_reason "length" when hit)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 samples from the full tempered distribution."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end a continuation (kept in the output); None means the tokenizer's EOS."""


@dataclass
class Generation:
    """One continuation: the sampled tokens, their behaviour log-probs and weight versions."""

    token_ids: list[int]
    logprobs: list[float]
    """log pi_behaviour(token) under the temperature-scaled full softmax (see HFEngine)."""
    versions: list[int]
    """Weight version that produced each token (changes mid-sequence if weights were swapped)."""
    finish_reason: Literal["stop", "length"]
    meta: dict[str, Any] = field(default_factory=dict)


class Engine(ABC):
    """A policy's inference runtime inside a RaaS node."""

    max_batch_size: int = 256
    """Concurrent ``agenerate`` requests are merged into batches of at most this many prompts."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Continuations of ``prompts`` (token ids), in order. Thread-safe against load_weights."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Replace the weights; tokens generated after this returns carry ``version``. May be called
        from another thread while ``generate`` runs: the swap lands between two decoding steps."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The current weights (for delta application and checks)."""

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Async ``generate``: requests from concurrent episodes are merged into one batch.

        A worker task per event loop drains the queue, groups requests by sampling params and runs
        each merged batch in a thread, so the event loop (Kafka I/O, other episodes) keeps running.
        """
        loop = asyncio.get_running_loop()
        if getattr(self, "_batch_loop", None) is not loop:
            self._batch_loop = loop
            self._batch_queue: asyncio.Queue = asyncio.Queue()
            self._batch_worker = loop.create_task(self._drain_requests())
        fut = loop.create_future()
        self._batch_queue.put_nowait((prompts, params, fut))
        return await fut

    async def _drain_requests(self) -> None:
        queue = self._batch_queue
        while True:
            items = [await queue.get()]
            await asyncio.sleep(0)  # let episodes that are ready in this tick enqueue too
            while not queue.empty():
                items.append(queue.get_nowait())
            by_params: dict[SamplingParams, list] = {}
            for item in items:
                by_params.setdefault(item[1], []).append(item)
            for params, group in by_params.items():
                await self._run_merged(params, group)

    async def _run_merged(self, params: SamplingParams, group: list) -> None:
        start = 0
        while start < len(group):
            chunk, n = [], 0
            while start < len(group) and (not chunk or n + len(group[start][0]) <= self.max_batch_size):
                chunk.append(group[start])
                n += len(group[start][0])
                start += 1
            merged = [p for prompts, _, _ in chunk for p in prompts]
            try:
                gens = await asyncio.to_thread(self.generate, merged, params)
            except Exception as exc:  # noqa: BLE001 - delivered to every waiting episode
                for _, _, fut in chunk:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            offset = 0
            for prompts, _, fut in chunk:
                if not fut.done():
                    fut.set_result(gens[offset: offset + len(prompts)])
                offset += len(prompts)
