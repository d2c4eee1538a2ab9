"""A SIMULATED inference engine for scale experiments on small machines (not a model).

What is simulated: the *time* generation takes and the *length* of responses. A node decodes like a
continuous-batching GPU server (vLLM-style): every running sequence gains ``tokens_per_s x speed``
tokens per second regardless of how many sequences share the batch (decode is memory-bound), up to
``max_batch_size`` sequences; more requests queue. Response lengths are drawn from a lognormal
long tail (``median_tokens``, ``sigma``; see :meth:`SimulatedEngineConfig.quantile`), truncated at
``max_tokens`` and at the request's ``max_new_tokens``. Token ids are uniform over ``vocab_size`` and
log-probs are plausible negatives: nothing is learnt, these runs measure scheduling.

What is real: the weights. ``update_weights`` receives real tensors pulled from the weight plane (the
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

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.engines.config import SimulatedEngineConfig
from astraflow.engines.seeding import row_keys
from astraflow.engines.weight_update import FullState, InPlacePatch, UpdateRefusedError, WeightUpdate


@dataclass
class _Sequence:
    rng: random.Random
    """This sequence's draws: its request's seed (:mod:`astraflow.engines.seeding`), else the engine's."""
    target: int
    capped: bool = False
    """True when ``max_new_tokens`` cut the drawn length (no EOS then)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    credit: float = 0.0


class SimulatedEngine(Engine):
    """Continuous-batching decode simulator; see the module docstring."""

    accepted_updates = frozenset({FullState, InPlacePatch})

    def __init__(self, config: SimulatedEngineConfig | dict[str, Any] | None = None, *, version: int = 0) -> None:
        self.config = config if isinstance(config, SimulatedEngineConfig) else \
            SimulatedEngineConfig.model_validate(config or {})
        self.max_batch_size = self.config.max_batch_size
        self._version = version
        self._weights: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(self.config.seed)
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
        """The tensors held (the very tensor objects: an in-place patch writes them)."""
        return dict(self._weights)

    def update_weights(self, update: WeightUpdate) -> None:
        """A full load (its tensor names must stay those loaded before) or an in-place patch of the
        tensors held; either lands between two simulation ticks."""
        if type(update) not in self.accepted_updates:
            raise UpdateRefusedError(self, type(update))
        if isinstance(update, FullState) and self._weights and set(update.state_dict) != set(self._weights):
            # Same rule as the HF engine's strict load: a broken chain must fail, not serve stale weights.
            raise ValueError(f"simulated engine: tensor names changed at v{update.version}: "
                             f"{sorted(set(update.state_dict) ^ set(self._weights))[:5]}")
        with self._lock:  # lands between two simulation ticks
            if isinstance(update, FullState):
                self._weights = dict(update.state_dict)
                self.stats["loads"] += 1
            else:
                update.write(self._weights)
                self.stats["patches"] = self.stats.get("patches", 0) + 1
            self._version = update.version

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
                    s.tokens.append(cfg.eos_token_id if last else s.rng.randrange(3, cfg.vocab_size))
                    s.logprobs.append(math.log(s.rng.uniform(0.05, 1.0)))
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
        for key in row_keys(params, n):
            rng = random.Random(self._rng.getrandbits(63) if key is None else key)
            length = self.config.draw_length(rng)
            out.append(_Sequence(rng, target=min(length, params.max_new_tokens), capped=length >= params.max_new_tokens))
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
