"""A SIMULATED inference engine for scale experiments on small machines (not a model).

What is simulated: the *time* generation takes and the *length* of responses. A node decodes like a
continuous-batching GPU server (vLLM-style): every running sequence gains ``tokens_per_s x speed``
tokens per second regardless of how many sequences share the batch (decode is memory-bound), up to
``max_batch_size`` sequences; more requests queue. Response lengths are drawn from a lognormal
long tail (``median_tokens``, ``sigma``; see :meth:`SimulatedEngineConfig.quantile`), truncated at
``max_tokens`` and at the request's ``max_new_tokens``. Token ids are uniform over ``vocab_size`` and
log-probs are plausible negatives: nothing is learnt, these runs measure scheduling.

What is real: the weights. ``load_weights`` receives real tensors pulled from the weight plane (the
simulated trainer publishes small ones), and every token is tagged with the version loaded when it
was decoded, so a swap mid-sequence shows up in the per-token versions exactly as with a real engine.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from astraflow.engines.base import Engine, Generation, SamplingParams


class SimulatedEngineConfig(BaseModel):
    """Timing and length model of the simulated engine (``engine.type: simulated``)."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_s: float = Field(default=200.0, gt=0)
    """Decode speed of ONE sequence at speed 1.0 (tokens/s); the node's batch decodes in parallel."""
    speed: float = Field(default=1.0, gt=0)
    """Node speed factor (1.0 = reference hardware, 0.3 = a pool at 30% throughput)."""
    median_tokens: float = Field(default=64.0, gt=0)
    """Median response length (the lognormal's exp(mu))."""
    sigma: float = Field(default=1.0, ge=0)
    """Lognormal shape: p99 = median * exp(2.326 * sigma) (sigma 1.0 -> p99 ~10x the median)."""
    max_tokens: int = Field(default=2048, ge=1)
    """Hard cap on a response (finish_reason "length")."""
    max_batch_size: int = Field(default=256, ge=1)
    """Sequences decoded at once by a node; further requests wait for a free slot."""
    tick_s: float = Field(default=0.02, gt=0)
    """Simulation time step: tokens are produced in chunks of ``tokens_per_s * speed * tick_s``."""
    vocab_size: int = Field(default=31, ge=4)
    """Token ids are drawn from [3, vocab_size) (the in-code tokenizer has 31; 0-2 are pad/bos/eos)."""
    eos_token_id: int = 2
    """Last token of a response that ends before its cap (finish_reason "stop")."""

    def quantile(self, q: float) -> float:
        """Response-length quantile of the (untruncated) lognormal, e.g. ``quantile(0.99)``."""
        z = math.sqrt(2.0) * _erfinv(2.0 * q - 1.0)
        return self.median_tokens * math.exp(self.sigma * z)

    def draw_length(self, rng: random.Random) -> int:
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(self.median_tokens), self.sigma))))


def _erfinv(y: float) -> float:
    # Newton on erf: enough for quantiles in docs and tests (no scipy dependency).
    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


@dataclass
class _Sequence:
    target: int
    capped: bool = False
    """True when ``max_new_tokens`` cut the drawn length (no EOS then)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    credit: float = 0.0


class SimulatedEngine(Engine):
    """Continuous-batching decode simulator; see the module docstring."""

    def __init__(self, config: SimulatedEngineConfig | dict | None = None, *, version: int = 0,
                 seed: int = 0) -> None:
        self.config = config if isinstance(config, SimulatedEngineConfig) else \
            SimulatedEngineConfig.model_validate(config or {})
        self.max_batch_size = self.config.max_batch_size
        self._version = version
        self._weights: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._active: list[_Sequence] = []
        self._waiting: list[_Sequence] = []
        self._wake: asyncio.Event | None = None
        self._ticker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: dict[int, asyncio.Future] = {}
        self.stats = {"busy_s": 0.0, "sequence_s": 0.0, "tokens": 0, "loads": 0}
        """Seconds with >= 1 sequence decoding, sequence-seconds decoded, tokens, weight loads."""

    # -- weights (real tensors from the weight plane) ----------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def state_dict(self) -> dict[str, Any]:
        return dict(self._weights)

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        if self._weights and set(state_dict) != set(self._weights):
            # Same rule as the HF engine's strict load: a broken chain must fail, not serve stale weights.
            raise ValueError(f"simulated engine: tensor names changed at v{version}: "
                             f"{sorted(set(state_dict) ^ set(self._weights))[:5]}")
        with self._lock:  # lands between two simulation ticks
            self._weights = dict(state_dict)
            self._version = version
            self.stats["loads"] += 1

    # -- one tick of decoding ----------------------------------------------------------------------
    def _admit(self) -> None:
        room = self.max_batch_size - len(self._active)
        if room > 0 and self._waiting:
            self._active += self._waiting[:room]
            del self._waiting[:room]

    def _advance(self, dt: float) -> list[_Sequence]:
        """Decode ``dt`` seconds for every active sequence; returns the sequences that finished."""
        cfg = self.config
        rate = cfg.tokens_per_s * cfg.speed
        finished = []
        with self._lock:
            version = self._version
            if self._active:
                self.stats["busy_s"] += dt
                self.stats["sequence_s"] += dt * len(self._active)
            for s in self._active:
                s.credit += rate * dt
                k = min(int(s.credit), s.target - len(s.tokens))
                s.credit -= k
                for _ in range(k):
                    last = len(s.tokens) == s.target - 1 and not s.capped
                    s.tokens.append(cfg.eos_token_id if last else self._rng.randrange(3, cfg.vocab_size))
                    s.logprobs.append(math.log(self._rng.uniform(0.05, 1.0)))
                    s.versions.append(version)
                self.stats["tokens"] += k
                if len(s.tokens) >= s.target:
                    finished.append(s)
            if finished:
                gone = {id(s) for s in finished}
                self._active = [s for s in self._active if id(s) not in gone]
        self._admit()
        return finished

    def _new_sequences(self, n: int, params: SamplingParams) -> list[_Sequence]:
        out = []
        for _ in range(n):
            length = self.config.draw_length(self._rng)
            out.append(_Sequence(target=min(length, params.max_new_tokens), capped=length >= params.max_new_tokens))
        return out

    @staticmethod
    def _generation(s: _Sequence, params: SamplingParams) -> Generation:
        reason = "length" if s.capped else "stop"
        return Generation(token_ids=s.tokens, logprobs=s.logprobs, versions=s.versions, finish_reason=reason)

    # -- blocking API ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Decode ``prompts`` alone (no other requests share the batch), in simulated real time."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
        seqs = self._new_sequences(len(prompts), params)
        pending = {id(s) for s in seqs}
        self._waiting += seqs
        self._admit()
        last = time.monotonic()
        while pending:
            time.sleep(self.config.tick_s)
            now = time.monotonic()
            for s in self._advance(now - last):
                pending.discard(id(s))
            last = now
        return [self._generation(s, params) for s in seqs]

    # -- async API: continuous batching across concurrent episodes ----------------------------------
    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Requests from concurrent episodes join the running batch at once (no waiting for the
        longest sequence of an earlier batch, as in vLLM's continuous batching)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._wake = loop, asyncio.Event()
            self._ticker = loop.create_task(self._tick_forever())
        seqs = self._new_sequences(len(prompts), params)
        futs = []
        for s in seqs:
            fut = loop.create_future()
            self._done[id(s)] = fut
            futs.append(fut)
        self._waiting += seqs
        self._admit()
        self._wake.set()
        await asyncio.gather(*futs)
        return [self._generation(s, params) for s in seqs]

    async def _tick_forever(self) -> None:
        last = time.monotonic()
        while True:
            if not self._active and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                last = time.monotonic()
            await asyncio.sleep(self.config.tick_s)
            now = time.monotonic()
            for s in self._advance(now - last):
                fut = self._done.pop(id(s), None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            last = now
