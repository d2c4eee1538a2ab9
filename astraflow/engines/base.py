"""The inference-engine contract: generate tokens with per-token behaviour log-probs and the weight
version that produced each token; swap weights between generation steps.

The contract is deliberately the one vLLM / SGLang expose (token ids in, token ids + log-probs out,
weights updated in place), so connectors for them implement the same four members. How an engine
is chosen and configured in a recipe: ``astraflow.engines.config``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from astraflow.engines.weight_update import FullState, WeightUpdate


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
    seed: int | None = field(default=None, compare=False)
    """Seeds this request's draws (:mod:`astraflow.engines.seeding`): its tokens then depend on the
    seed and the weights only, not on the requests decoded beside it. None: the engine's generator.
    Not compared, so requests that differ only in their seeds still share a batch."""
    row_seeds: tuple[int | None, ...] | None = field(default=None, compare=False)
    """One key per prompt instead of ``seed`` (set by a batcher that merges seeded requests)."""


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

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Continuations of ``prompts`` (token ids), in order. Thread-safe against update_weights."""

    accepted_updates: frozenset[type[WeightUpdate]] = frozenset({FullState})
    """The weight update kinds :meth:`update_weights` takes; the weight plane builds the cheapest of
    them (:mod:`astraflow.engines.weight_update`). :class:`InPlacePatch` needs :meth:`state_dict` to
    return the tensors the engine serves from, not copies. This default: whole state dicts only (set per
    class; per instance by an engine that wraps another)."""

    @abstractmethod
    def update_weights(self, update: WeightUpdate) -> None:
        """Apply ``update`` (one of :attr:`accepted_updates`, else :class:`UpdateRefusedError`); tokens
        generated after this returns carry ``update.version``. May be called from another thread while
        ``generate`` runs: the swap lands between two decoding steps."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The current weights by their published names (for checks; for an engine that accepts
        :class:`InPlacePatch`, the very tensors it serves from, which the patch writes)."""

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """``generate`` without blocking the event loop (Kafka I/O, other episodes keep running).

        Concurrent episodes call this at once. This default runs each call on its own in a thread;
        an engine that can serve them together overrides it: the HF engine merges them into batches
        (``astraflow.engines.batching``), the simulated engine and vLLM batch continuously.
        """
        return await asyncio.to_thread(self.generate, prompts, params)
