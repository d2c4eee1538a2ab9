"""Continuous batching for the built-in engine's eager path: a request's rows join the running batch
between two decoding steps and each row leaves it the step it finishes.

Why: with request batching (:mod:`astraflow.engines.batching`) a merged batch decodes until its
longest row ends, rows that finished decoding padding meanwhile, and the requests that arrive during
it wait for the whole batch. A node's episodes end at different lengths, so in a run the engine did
a fraction of the work it does on a full batch (``benchmarks/node_fill.py``). Serving engines (vLLM,
SGLang) schedule every step instead; :class:`ContinuousBatcher` does the same over transformers'
dynamic KV cache:

* one decoding thread owns the running batch; :meth:`ContinuousBatcher.submit` queues a request and
  awaits its generations (a request is never split: its rows join together);
* before each step the waiting requests join while the batch has room (``max_rows``; a larger request
  runs alone): their distinct prompts are prefilled once each and their KV rows appended to the
  running cache, both sides left-padded to one length (keys are stored rotated by their own
  positions, so padding columns added on the left change nothing a row attends to);
* a row ends at its stop token or ``max_new_tokens`` (its request answered once all its rows ended) and
  decodes padding until the batch is compacted: when a quarter of its rows have ended, or before
  requests join (compacting copies every layer's cache, too dear to do each step); the columns no
  remaining row attends to are then cut from the left, so the cache is as long as the longest live
  context, not the run's history;
* a weight swap lands between two steps (the engine's :class:`~astraflow.engines.swap_gate.SwapGate`),
  and every token carries the version of the weights that computed it, as in ``HFEngine.generate``.

Log-probs, per-token versions and sampling mean exactly what they mean in ``HFEngine.generate``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.engines.base import Generation, SamplingParams
from astraflow.engines.decoding import ForwardArgs, PaddedBatch, cache_of, prefill_distinct

if TYPE_CHECKING:
    import torch

    from astraflow.engines.swap_gate import SwapGate

log = logging.getLogger(__name__)


@dataclass(eq=False)  # hashed by identity: a request is one caller's
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    stops: frozenset[int]
    future: asyncio.Future[list[Generation]]
    loop: asyncio.AbstractEventLoop
    rows: list[_Row] = field(default_factory=list)
    answered: bool = False


@dataclass(eq=False)
class _Row:
    request: _Request
    key: int
    """Seeds this row's draws (:mod:`astraflow.engines.seeding`)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False

    def generation(self) -> Generation:
        stopped = bool(self.tokens) and self.tokens[-1] in self.request.stops
        return Generation(token_ids=self.tokens, logprobs=self.logprobs, versions=self.versions,
                          finish_reason="stop" if stopped else "length")


@dataclass(frozen=True)
class DecoderParts:
    """What the batcher decodes with: the engine's own model, gate and sampler (shared, not copied)."""

    model: Any
    args: ForwardArgs
    device: Any
    pad_token_id: int
    eos_token_id: int | None
    gate: SwapGate
    version: Callable[[], int]
    """The version of the weights loaded now (read inside the gate)."""
    sample: Callable[[Any, float, Any, Any], Any]
    """One token per row from log-probs, a top-p, the rows' keys and token indices: the engine's sampler."""
    keys: Callable[[SamplingParams, int], list[int]]
    """A request's row keys (its seed's, else drawn from the engine's generator)."""


class RunningCache:
    """The running rows' dynamic KV cache, attention mask, positions and next input tokens."""

    def __init__(self, cache: Any, mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache, self.mask, self.positions = cache, mask, positions
        """``mask``: rows x cache length (0 on left padding); ``positions``: rows x 1, the last one."""

    @classmethod
    def prefill(cls, parts: DecoderParts, prompts: list[list[int]]) -> tuple[RunningCache, torch.Tensor]:
        """The prompts' cache (each distinct prompt computed once, copied to its rows) and the
        next-token logits of every row."""
        b = PaddedBatch(prompts, parts.pad_token_id, parts.device)
        out = prefill_distinct(parts.model, b, parts.args)
        cache, logits = cache_of(out), out.logits[:, -1, :]
        if len(b.first) < b.n:
            cache.reorder_cache(b.copies)
            logits = logits[b.copies]
        return cls(cache, b.mask, b.positions[:, -1:].clone()), logits

    def step(self, parts: DecoderParts, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; next-token logits."""
        import torch

        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        self.positions = self.positions + 1
        out = parts.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.positions,
                          use_cache=True, **{parts.args.cache: self.cache}, **parts.args.keep)
        self.cache = cache_of(out)
        return out.logits[:, -1, :]

    def extend(self, other: RunningCache) -> None:
        """Append ``other``'s rows (after this one's), both left-padded to the longer cache."""
        import torch
        import torch.nn.functional as F

        length = max(self.mask.shape[1], other.mask.shape[1])
        mine, theirs = length - self.mask.shape[1], length - other.mask.shape[1]
        for a, b in zip(self.cache.layers, other.cache.layers, strict=True):
            a.keys = torch.cat([F.pad(a.keys, (0, 0, mine, 0)), F.pad(b.keys, (0, 0, theirs, 0))])
            a.values = torch.cat([F.pad(a.values, (0, 0, mine, 0)), F.pad(b.values, (0, 0, theirs, 0))])
        self.mask = torch.cat([F.pad(self.mask, (mine, 0)), F.pad(other.mask, (theirs, 0))])
        self.positions = torch.cat([self.positions, other.positions])

    def keep(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` (indices, in order) and cut the columns none of them attends to."""
        self.mask, self.positions = self.mask[rows], self.positions[rows]
        first = int(self.mask.any(dim=0).int().argmax())  # the first column a kept row attends to
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[rows, :, first:], layer.values[rows, :, first:]
        self.mask = self.mask[:, first:]

    @property
    def length(self) -> int:
        return self.mask.shape[1]


def supports(model: Any) -> bool:
    """Whether ``model``'s dynamic cache is all plain layers (rows are moved by editing each layer's
    keys and values); a sliding-window or other layer keeps state of its own."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - a config the cache cannot read: not supported
        return False
    return all(type(layer) is DynamicLayer for layer in layers)


class ContinuousBatcher:
    """Schedules concurrent requests onto one running batch (see the module docstring)."""

    def __init__(self, parts: DecoderParts, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.parts = parts
        self.max_batch_size = max_rows
        """Most rows decoded at once (a single larger request still runs, alone)."""
        self._waiting: queue.Queue[_Request] = queue.Queue()
        self._next: _Request | None = None
        """A request taken from the queue that did not fit yet: it joins first, before later ones."""
        self._rows: list[_Row] = []
        self._cache: RunningCache | None = None
        self._tokens: torch.Tensor | None = None
        """Each running row's newest token (the next step's input)."""
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.steps = 0
        """Decoding steps taken (prefills of joining rows not counted)."""

    async def submit(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """The generations of ``prompts``, decoded in the running batch."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
        loop = asyncio.get_running_loop()
        stops = frozenset(params.stop_token_ids if params.stop_token_ids is not None else [self.parts.eos_token_id])
        request = _Request(prompts, params, stops, loop.create_future(), loop)
        self._ensure_thread()
        self._waiting.put(request)
        return await request.future

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="hf-continuous-decode", daemon=True)
                self._thread.start()

    # -- the decoding thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            joining = self._take(block=not self._rows)
            if not self._rows and not joining:
                continue
            try:
                self._iterate(joining)
            except Exception as exc:  # delivered to every request in the batch
                log.exception("hf engine: continuous batch failed; failing its %d requests", len(self._requests()))
                for r in {*self._requests(), *joining}:
                    _resolve(r, exc)
                self._rows, self._cache, self._tokens = [], None, None

    def _take(self, block: bool) -> list[_Request]:
        """The waiting requests that fit beside the running rows, in arrival order."""
        joining: list[_Request] = []
        room = self.max_batch_size - sum(not row.done for row in self._rows)
        while True:
            request = self._next
            self._next = None
            if request is None:
                try:
                    request = self._waiting.get(block=block and not joining, timeout=None)
                except queue.Empty:
                    return joining
            if request.future.cancelled():
                continue
            if len(request.prompts) > room and (self._rows or joining):
                self._next = request  # waits for rows to leave; nothing overtakes it
                return joining
            joining.append(request)
            room -= len(request.prompts)

    def _requests(self) -> list[_Request]:
        return list(dict.fromkeys(r.request for r in self._rows))

    def _iterate(self, joining: list[_Request]) -> None:
        import torch

        parts = self.parts
        new_prompts = [p for r in joining for p in r.prompts]
        if joining:
            self._compact()  # ended rows make room for the joining ones
        with torch.no_grad(), parts.gate.step():  # a weight swap lands between steps, never inside one
            logits = []
            if self._rows:
                logits.append(self._cache.step(parts, self._tokens))
                self.steps += 1
            if new_prompts:
                joined, new_logits = RunningCache.prefill(parts, new_prompts)
                if self._cache is None:
                    self._cache = joined
                else:
                    self._cache.extend(joined)
                logits.append(new_logits)
                for r in joining:
                    r.rows = [_Row(r, k) for k in self.parts.keys(r.params, len(r.prompts))]
                    self._rows.extend(r.rows)
            version = parts.version()
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        nxt, chosen = self._sample(logits.float())
        nxt_list, chosen_list = nxt.tolist(), chosen.tolist()
        for row, token, logp in zip(self._rows, nxt_list, chosen_list, strict=True):
            if row.done:
                continue  # an ended row decoding padding until the next compaction
            row.tokens.append(token)
            row.logprobs.append(logp)
            row.versions.append(version)
            row.done = token in row.request.stops or len(row.tokens) >= row.request.params.max_new_tokens
        self._tokens = nxt
        self._retire()

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its log-prob, by its request's sampling parameters."""
        import torch

        groups: dict[SamplingParams, list[int]] = {}
        for i, row in enumerate(self._rows):
            groups.setdefault(row.request.params, []).append(i)
        if len(groups) == 1:
            return self._sample_group(logits, next(iter(groups)), self._rows)
        nxt = torch.empty(len(self._rows), dtype=torch.long, device=logits.device)
        chosen = torch.empty(len(self._rows), dtype=logits.dtype, device=logits.device)
        for params, idx in groups.items():
            rows = torch.tensor(idx, device=logits.device)
            nxt[rows], chosen[rows] = self._sample_group(logits[rows], params, [self._rows[i] for i in idx])
        return nxt, chosen

    def _sample_group(self, logits: torch.Tensor, params: SamplingParams,
                      rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        if params.temperature <= 0:
            logp = torch.log_softmax(logits, dim=-1)
            nxt = logp.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            keys = torch.tensor([r.key for r in rows], device=logits.device)
            steps = torch.tensor([len(r.tokens) for r in rows], device=logits.device)
            nxt = self.parts.sample(logp, params.top_p, keys, steps)
        return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)

    def _retire(self) -> None:
        """Answer the requests whose rows have all ended; compact once a quarter of the rows have."""
        ended = 0
        for row in self._rows:
            ended += row.done or row.request.future.cancelled()
            request = row.request
            if row.done and not request.answered and all(r.done for r in request.rows):
                request.answered = True
                _resolve(request, [r.generation() for r in request.rows])
        if ended == len(self._rows) or ended * 4 >= len(self._rows):
            self._compact()

    def _compact(self) -> None:
        """Drop the ended rows (and those of cancelled requests) from the batch and its cache."""
        import torch

        keep = [i for i, row in enumerate(self._rows) if not row.done and not row.request.future.cancelled()]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._tokens = [], None, None
            return
        index = torch.tensor(keep, device=self._tokens.device)
        self._rows = [self._rows[i] for i in keep]
        self._tokens = self._tokens[index]
        self._cache.keep(index)


def _resolve(request: _Request, result: list[Generation] | BaseException) -> None:
    """Hand a request its generations (or the batch's error) on the loop that awaits them."""

    def deliver() -> None:
        if request.future.done():
            return
        if isinstance(result, BaseException):
            request.future.set_exception(result)
        else:
            request.future.set_result(result)

    try:
        request.loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # that loop is closed: nobody waits any more
        pass
