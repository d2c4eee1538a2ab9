"""The inference-engine contract: generate tokens with per-token behaviour log-probs and the weight
version that produced each token; swap weights between generation steps.

The contract is deliberately the one vLLM / SGLang expose (token ids in, token ids + log-probs out,
weights updated in place), so connectors for them implement the same four members. How an engine
is chosen and configured in a recipe: ``astraflow.engines.config``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig


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

    def load_published(self, cfg: ClusterConfig, policy: str, version: int, *, subscriber_id: str) -> bool:
        """Bring the engine to ``version`` of ``policy`` as published in ``cfg``'s bucket by fetching
        it itself (an engine in another process, e.g. a vLLM server whose workers read the bucket,
        registered there as ``subscriber_id``); tokens generated after this returns carry
        ``version``. Raises :class:`~astraflow.delta.NoPathError` when the version cannot be reached.
        False (this default): the engine fetches nothing; the node pulls and calls :meth:`load_weights`."""
        return False

    def live_weights(self) -> dict[str, Any] | None:
        """The tensors the engine serves from, by their published names, when the weight plane may
        patch them in place (:meth:`patch_weights`); None (this default): every refresh is a
        :meth:`load_weights` of a whole state dict."""
        return None

    def patch_weights(self, write: Callable[[dict[str, Any]], None], version: int) -> None:
        """Run ``write(live_weights())`` between two decoding steps (the only time the engine
        pauses for a delta refresh); tokens generated after this returns carry ``version``."""
        raise NotImplementedError(f"{type(self).__name__} does not patch its weights in place")

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """``generate`` without blocking the event loop (Kafka I/O, other episodes keep running).

        Concurrent episodes call this at once. This default runs each call on its own in a thread;
        an engine that can serve them together overrides it: the HF engine merges them into batches
        (``astraflow.engines.batching``), the simulated engine and vLLM batch continuously.
        """
        return await asyncio.to_thread(self.generate, prompts, params)
