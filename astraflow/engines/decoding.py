"""How the HF engine runs its forwards: a prefill, then one forward per decoding step.

Two ways, behind one small interface (:class:`DecodeSession`: ``prefill()`` then ``step(tokens)``,
each giving next-token logits for every row):

* **eager** (:class:`EagerSession`): transformers' dynamic KV cache, every step through Python.
  The attention mask and cache grow by one column per step, so no two steps have the same shapes.
* **static** (:class:`StaticDecoder`): transformers' ``StaticCache`` of a bucketed shape (rows and
  length rounded up, so few shapes recur) with the one-token decode forward compiled by
  ``torch.compile`` (``mode="reduce-overhead"``: captured as a CUDA graph on a GPU). The step's
  inputs keep one shape: a full-length attention mask updated in place. On a GPU the eager step is
  bound by kernel launches and Python (~20 ms a step whatever the batch: gpu-playbook.md), which
  the captured graph removes.

Both prefill each distinct prompt once (the samples of a GRPO group share their prompt) and give
every row a copy of its prompt's KV cache. The static cache is reset at every session: a batch
never reads the keys and values of an earlier batch. Weights are the model's own tensors in both
ways, read by reference, so an in-place patch or ``load_state_dict`` between two steps is what the
next step computes with (the graph reads the same storage; no re-capture).
"""

from __future__ import annotations

import inspect
import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Row counts a static cache is built for; a batch is padded up to the next (the padding rows
decode a copy of the first prompt and are discarded). Finer above 32 so padding wastes < 50%."""
LENGTH_QUANTUM = 128
"""Static caches hold prompt + new tokens rounded up to a multiple of this."""
DECODE_THREAD = "hf-static-decode"
"""Name (prefix) of the thread a static decoder runs every batch on."""
MAX_CACHES = 4
"""Static caches kept at once, the least recently used dropped first: each holds rows x length x
layers x 2 of the model's KV (SmolLM2-135M at 128 x 256: 0.36 GB in bf16; a 7B model's at 256 x 2048:
~64 GB), beside the trainer where both share a GPU."""


class DecodeSession(ABC):
    """One batch's forwards: ``prefill`` once, then ``step`` with each row's newest token."""

    @abstractmethod
    def prefill(self) -> torch.Tensor:
        """Next-token logits (rows x vocab) after every row's prompt."""

    @abstractmethod
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (shape ``(rows,)``); next-token logits (rows x vocab)."""


class PaddedBatch:
    """A left-padded batch (the next token is always at the right edge) and its distinct prompts."""

    def __init__(self, prompts: list[list[int]], pad_token_id: int, device: torch.device) -> None:
        import torch

        self.n, self.width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((self.n, self.width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((self.n, self.width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, self.width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, self.width - len(p):] = 1
        self.ids, self.mask = ids.to(device), mask.to(device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        first: list[int] = []
        seen: dict[tuple[int, ...], int] = {}
        copies = []
        for i, p in enumerate(prompts):
            key = tuple(p)
            if key not in seen:
                seen[key] = len(first)
                first.append(i)
            copies.append(seen[key])
        self.first = torch.tensor(first, device=device)
        """The first row of each distinct prompt (prefilled once)."""
        self.copies = torch.tensor(copies, device=device)
        """For every row, its prompt's index in ``first``."""


@dataclass(frozen=True)
class ForwardArgs:
    """What a model's forward is called with, read once from its signature."""

    cache: str
    """Its name for the KV cache: ``cache`` from transformers 5.2x on (``past_key_values`` is
    deprecated there, with a warning per call), ``past_key_values`` before."""
    keep: dict[str, int]
    """``logits_to_keep=1`` where the model takes it: the lm-head at the last position only (a
    prompt's other positions' logits are never used)."""

    @classmethod
    def of(cls, model: Any) -> ForwardArgs:
        params = inspect.signature(model.forward).parameters
        return cls("cache" if "cache" in params else "past_key_values",
                   {"logits_to_keep": 1} if "logits_to_keep" in params else {})


def prefill_distinct(model: Any, b: PaddedBatch, args: ForwardArgs) -> Any:
    """The forward of each distinct prompt once, into a fresh dynamic cache."""
    return model(input_ids=b.ids[b.first], attention_mask=b.mask[b.first], position_ids=b.positions[b.first],
                 use_cache=True, **{args.cache: None}, **args.keep)


def cache_of(out: Any) -> Any:
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


class EagerSession(DecodeSession):
    """A dynamic cache; shapes grow every step (see the module docstring)."""

    def __init__(self, model: Any, prompts: list[list[int]], pad_token_id: int, device: torch.device,
                 args: ForwardArgs) -> None:
        self.model, self.device, self.args = model, device, args
        self.batch = PaddedBatch(prompts, pad_token_id, device)
        self.mask, self.positions = self.batch.mask, self.batch.positions
        self.cache: Any = None

    def prefill(self) -> torch.Tensor:
        b = self.batch
        out = prefill_distinct(self.model, b, self.args)
        self.cache = cache_of(out)
        logits = out.logits[:, -1, :]
        if len(b.first) < b.n:  # every row gets a copy of its prompt's cache and logits
            self.cache.reorder_cache(b.copies)
            logits = logits[b.copies]
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch

        n = self.batch.n
        self.mask = torch.cat([self.mask, torch.ones((n, 1), dtype=self.mask.dtype, device=self.device)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.positions,
                         use_cache=True, **{self.args.cache: self.cache}, **self.args.keep)
        self.cache = cache_of(out)
        return out.logits[:, -1, :]


class StaticDecoder:
    """Static caches by bucket and the compiled decode step, kept across batches (see the module
    docstring). One per engine; its sessions run one at a time (the engine decodes one batch at a time)."""

    def __init__(self, model: Any, device: torch.device, args: ForwardArgs, *, compile_backend: str = "inductor",
                 compile_mode: str | None = "reduce-overhead") -> None:
        import torch

        self.model, self.device, self.args = model, device, args
        self._caches: OrderedDict[tuple[int, int], Any] = OrderedDict()
        refuse_sliding_windows(model)
        options = {"mode": compile_mode} if compile_backend == "inductor" and compile_mode else {}
        # One compile serves every bucket: a session marks rows and length dynamic (a 1-row batch
        # compiles once more: torch specialises sizes of 1). A compile of SmolLM2-135M's step took
        # 78-96 s on 2 CPU cores; CUDA graphs are still recorded per bucket, in milliseconds. The
        # compiled code is transformers' forward wrapper, shared by every model in the process, so
        # its recompile limit (process-wide) is raised to leave room for several engines' compiles.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self._step = torch.compile(model.forward, backend=compile_backend, fullgraph=True, **options)
        self._mark_step = getattr(torch.compiler, "cudagraph_mark_step_begin", None) if device.type == "cuda" else None
        # torch keeps CUDA graphs per thread (cudagraph_trees' tree managers are thread-local): a node
        # calls generate from whichever worker thread asyncio hands it, so every batch decodes on this
        # one thread, or each thread would record (and hold memory for) graphs of its own.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=DECODE_THREAD)
        log.info("hf engine: static KV cache, decode step compiled (backend %s, mode %s)", compile_backend, compile_mode)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the decoder's own thread (see ``__init__``); directly when already on it."""
        if threading.current_thread().name.startswith(DECODE_THREAD):
            return fn(*args)
        return self._thread.submit(fn, *args).result()

    @staticmethod
    def buckets(rows: int, length: int) -> tuple[int, int]:
        """The (rows, cache length) a batch of ``rows`` needing ``length`` positions is decoded in."""
        padded = next((b for b in ROW_BUCKETS if b >= rows), -(-rows // ROW_BUCKETS[-1]) * ROW_BUCKETS[-1])
        return padded, -(-length // LENGTH_QUANTUM) * LENGTH_QUANTUM

    def session(self, prompts: list[list[int]], pad_token_id: int, max_new_tokens: int) -> StaticSession:
        from transformers import StaticCache

        width = max(len(p) for p in prompts)
        key = self.buckets(len(prompts), width + max_new_tokens)
        cache = self._caches.pop(key, None)
        if cache is None:
            while len(self._caches) >= MAX_CACHES:
                self._caches.popitem(last=False)
            cache = StaticCache(config=self.model.config, max_cache_len=key[1])
        self._caches[key] = cache  # now the most recently used
        cache.reset()  # zeroes keys, values and the write position: nothing of an earlier batch is read
        return StaticSession(self, prompts, pad_token_id, cache, key)

    def forward_step(self, **inputs: Any) -> Any:
        if self._mark_step is not None:
            self._mark_step()  # a new CUDA-graph replay: the last step's outputs were consumed
        return self._step(**inputs)


class StaticSession(DecodeSession):
    """One batch decoded in a bucket's static cache (rows padded with copies of the first prompt)."""

    def __init__(self, decoder: StaticDecoder, prompts: list[list[int]], pad_token_id: int, cache: Any,
                 bucket: tuple[int, int]) -> None:
        import torch

        self.decoder, self.cache = decoder, cache
        self.batch = b = PaddedBatch(prompts, pad_token_id, decoder.device)
        rows, length = bucket
        self.rows = torch.cat([b.copies, b.copies.new_zeros(rows - b.n)])
        """Each cache row's prompt index: the batch's rows, then padding rows copying prompt 0."""
        self.mask = torch.zeros((rows, length), dtype=torch.long, device=decoder.device)
        self.mask[:, :b.width] = b.mask[b.first][self.rows]
        # a fresh tensor, not a view: a view's row stride is the prompt width, and the compiled step
        # guards on strides
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=decoder.device)
        self.positions[:, 0] = b.positions[b.first][self.rows][:, -1]
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=decoder.device)
        self.t = b.width

    def prefill(self) -> torch.Tensor:
        """The distinct prompts through the eager model into a dynamic cache, then copied row by
        row into the static one (its ``update`` writes positions 0..width-1 and advances it)."""
        b = self.batch
        out = prefill_distinct(self.decoder.model, b, self.decoder.args)
        for i, layer in enumerate(cache_of(out).layers):
            self.cache.update(layer.keys[self.rows], layer.values[self.rows], i)
        self._rows_and_length_vary()
        return out.logits[:, -1, :][b.copies]

    def _rows_and_length_vary(self) -> None:
        """Tell torch.compile that the step's rows and cache length vary (buckets), so that its first
        compile already serves every bucket (a size of 1 stays specialised: torch's rule)."""
        import torch

        for tensor, dims in ((self.tokens, (0,)), (self.positions, (0,)), (self.mask, (0, 1)),
                             *((t, (0, 2)) for layer in self.cache.layers for t in (layer.keys, layer.values))):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        n = self.batch.n
        self.tokens[:n, 0] = tokens
        self.mask[:, self.t] = 1
        self.t += 1
        self.positions += 1
        out = self.decoder.forward_step(input_ids=self.tokens, attention_mask=self.mask, position_ids=self.positions,
                                        use_cache=True, **{self.decoder.args.cache: self.cache})
        # a copy: the logits live in the CUDA graph's output pool, which the next replay overwrites
        return out.logits[:n, -1, :].clone()


def refuse_sliding_windows(model: Any) -> None:
    """The prefill's dynamic cache keeps a sliding-window layer's last window only, which the static
    cache's layers of that kind would place differently: full attention only, said up front."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    layers = StaticCache(config=model.config, max_cache_len=LENGTH_QUANTUM).layers  # allocates nothing yet
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not StaticLayer})
    if kinds:
        raise ValueError(f"decode: static supports full-attention models only; {type(model).__name__} has "
                         f"{', '.join(kinds)} layers: use decode: eager")
