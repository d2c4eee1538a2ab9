"""The one-token decode step replayed from a recorded graph per batch bucket, as serving engines do it
(SGLang's CUDA graph runner, nano-vllm): ``decode: graphs`` of the built-in engine.

On a GPU an eager decode step of a small model is bound by kernel launches and Python (~20-40 ms a
step whatever the batch: gpu-playbook.md); a CUDA graph replays the step's kernels in one launch.
Unlike ``decode: static`` (torch.compile, minutes of inductor compile before the first token), the
graph is recorded directly over the eager forward with ``torch.cuda.CUDAGraph``: milliseconds per
bucket, every bucket's graph in one shared memory pool (``torch.cuda.graph_pool_handle``).

A graph reads and writes fixed tensors, so each bucket (rows rounded up to :data:`ROW_BUCKETS`,
cache length to :data:`LENGTH_QUANTUM`) owns a :class:`GraphSlot`: a ``StaticCache`` and the step's
inputs (tokens, positions, a prepared 4-D additive attention mask: the model then builds no mask, whose
padding check would read the device from the host mid-capture) and its output logits. A batch:

1. is padded to its bucket (padding rows decode a copy of the first prompt and are discarded);
2. prefills each distinct prompt once, eagerly, and copies every row's keys and values into the slot's
   cache (``Cache.update``), which is reset first: no batch reads another's keys and values;
3. writes each step's tokens into the slot's inputs, opens one more mask column and replays.

The first step of a bucket records its graph (after a warm-up run on a side stream, as CUDA graph
capture requires); the cache's write position, which recording advanced, is put back, and the
recorded step writes the same keys and values again when replayed. Weights are read by address: an
in-place patch or ``load_state_dict`` (which copies into the parameters) between two steps is what
the next replay computes with; a load that replaced a parameter tensor would not be, so
:meth:`GraphDecoder.check_weights` (at each batch's start, never per step: it walks every tensor; a
weight update between steps writes in place) refuses to replay over moved weights.

How a step is recorded is a :class:`StepRecorder`: :class:`CudaGraphRecorder` on CUDA,
:class:`EagerRecorder` (replay = run the step eagerly over the same fixed tensors) on a CPU, which
drives the same bucketing, padding, cache copying and update logic in the tests.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from astraflow.engines.decoding import (
    LENGTH_QUANTUM,
    DecodeSession,
    ForwardArgs,
    PaddedBatch,
    cache_of,
    prefill_distinct,
    refuse_sliding_windows,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
"""Row counts a graph is recorded for (SGLang's spacing: every 8 to 32, then 16, then 32 ...): a batch is
padded to the next, so padding wastes under 25% above 8 rows."""
MAX_SLOTS = 8
"""Buckets (cache + graph) kept at once, the least recently used dropped first (its memory with it)."""


class StepRecorder(ABC):
    """Turns a step (a function over fixed tensors) into its replay."""

    @abstractmethod
    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        """The replay of ``step``; ``step`` has run (at least) once when this returns."""


class EagerRecorder(StepRecorder):
    """Replay = run the step again (a CPU engine, and the tests of everything around the graph)."""

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        step()
        return step


class CudaGraphRecorder(StepRecorder):
    """``torch.cuda.CUDAGraph`` capture, every graph of this recorder in one memory pool."""

    def __init__(self, warmups: int = 2) -> None:
        import torch

        self.pool = torch.cuda.graph_pool_handle()
        self.warmups = warmups
        self.graphs: list[Any] = []

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisations (cuBLAS workspaces, ...) happen outside capture
            for _ in range(self.warmups):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        self.graphs.append(graph)
        return graph.replay


def default_recorder(device: torch.device) -> StepRecorder:
    return CudaGraphRecorder() if device.type == "cuda" else EagerRecorder()


class GraphSlot:
    """One bucket's static cache, the step's fixed inputs and output, and (once recorded) its replay."""

    def __init__(self, model: Any, device: torch.device, rows: int, length: int) -> None:
        import torch
        from transformers import StaticCache

        self.rows, self.length = rows, length
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        dtype = next(model.parameters()).dtype
        self.blocked = torch.finfo(dtype).min
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.cache_position = torch.zeros((1,), dtype=torch.long, device=device)
        self.mask = torch.full((rows, 1, 1, length), self.blocked, dtype=dtype, device=device)
        """Additive: 0 where a row attends, the dtype's minimum elsewhere (padding, future columns)."""
        self.logits: torch.Tensor | None = None
        self.replay: Callable[[], None] | None = None


class GraphDecoder:
    """Slots by bucket and their recorded steps, kept across batches (see the module docstring)."""

    def __init__(self, model: Any, device: torch.device, args: ForwardArgs, recorder: StepRecorder | None = None,
                 max_slots: int = MAX_SLOTS) -> None:
        self.model, self.device, self.args = model, device, args
        self.recorder = recorder or default_recorder(device)
        self.max_slots = max_slots
        self._slots: OrderedDict[tuple[int, int], GraphSlot] = OrderedDict()
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self._weights = self._weight_addresses()
        refuse_sliding_windows(model)
        log.info("hf engine: static KV cache, decode step recorded per bucket (%s)", type(self.recorder).__name__)

    @staticmethod
    def buckets(rows: int, length: int) -> tuple[int, int]:
        """The (rows, cache length) a batch of ``rows`` needing ``length`` positions is decoded in."""
        padded = next((b for b in ROW_BUCKETS if b >= rows), -(-rows // ROW_BUCKETS[-1]) * ROW_BUCKETS[-1])
        return padded, -(-length // LENGTH_QUANTUM) * LENGTH_QUANTUM

    @property
    def recorded(self) -> list[tuple[int, int]]:
        """The buckets whose step is recorded now."""
        return [key for key, slot in self._slots.items() if slot.replay is not None]

    def session(self, prompts: list[list[int]], pad_token_id: int, max_new_tokens: int) -> GraphSession:
        self.check_weights()
        width = max(len(p) for p in prompts)
        key = self.buckets(len(prompts), width + max_new_tokens)
        slot = self._slots.pop(key, None)
        if slot is None:
            while len(self._slots) >= self.max_slots:
                self._slots.popitem(last=False)
            slot = GraphSlot(self.model, self.device, *key)
        self._slots[key] = slot  # now the most recently used
        slot.cache.reset()  # zeroes keys, values and the write position: nothing of an earlier batch is read
        return GraphSession(self, slot, prompts, pad_token_id)

    def _weight_addresses(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.model.state_dict().items()}

    def check_weights(self) -> None:
        """A recorded step reads the weights where they were when it was recorded: refuse to replay
        over a parameter that was replaced instead of written in place."""
        if self._weight_addresses() != self._weights:
            raise RuntimeError("decode: graphs: a weight tensor was replaced, not written in place; the recorded "
                               "steps would read the old one (load weights with load_state_dict or an in-place patch)")

    def record(self, slot: GraphSlot) -> None:
        """Record ``slot``'s step (its inputs hold the first real step's); its write position put back."""
        model, args = self.model, self.args
        extra = {"cache_position": slot.cache_position} if self.takes_cache_position else {}

        def step() -> None:
            out = model(input_ids=slot.tokens, attention_mask=slot.mask, position_ids=slot.positions,
                        use_cache=True, **{args.cache: slot.cache}, **args.keep, **extra)
            if slot.logits is None:
                slot.logits = out.logits[:, -1, :].clone()
            else:
                slot.logits.copy_(out.logits[:, -1, :])

        positions = _write_positions(slot.cache)
        slot.replay = self.recorder.record(step)
        _restore_write_positions(slot.cache, positions)
        log.info("hf engine: recorded the decode step of bucket rows=%d length=%d", slot.rows, slot.length)


class GraphSession(DecodeSession):
    """One batch decoded in its bucket's slot (rows padded with copies of the first prompt)."""

    def __init__(self, decoder: GraphDecoder, slot: GraphSlot, prompts: list[list[int]], pad_token_id: int) -> None:
        import torch

        self.decoder, self.slot = decoder, slot
        self.batch = b = PaddedBatch(prompts, pad_token_id, decoder.device)
        self.rows = torch.cat([b.copies, b.copies.new_zeros(slot.rows - b.n)])
        """Each slot row's prompt index: the batch's rows, then padding rows copying prompt 0."""
        slot.mask.fill_(slot.blocked)
        prompt_mask = b.mask[b.first][self.rows].bool()
        slot.mask[:, 0, 0, :b.width].masked_fill_(prompt_mask, 0.0)
        slot.positions.copy_(b.positions[b.first][self.rows][:, -1:])
        slot.tokens.zero_()
        self.t = b.width

    def prefill(self) -> torch.Tensor:
        """The distinct prompts through the eager model into a dynamic cache, then copied row by row
        into the slot's static one (its ``update`` writes positions 0..width-1 and advances it)."""
        b, slot = self.batch, self.slot
        out = prefill_distinct(self.decoder.model, b, self.decoder.args)
        for i, layer in enumerate(cache_of(out).layers):
            slot.cache.update(layer.keys[self.rows], layer.values[self.rows], i)
        return out.logits[:, -1, :][b.copies]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        slot, n = self.slot, self.batch.n
        slot.tokens[:n, 0] = tokens
        slot.mask[:, 0, 0, self.t] = 0.0
        slot.cache_position.fill_(self.t)
        slot.positions += 1
        self.t += 1
        if slot.replay is None:
            self.decoder.record(slot)  # runs this step too; the replay below writes the same keys and values
        slot.replay()
        return slot.logits[:n].clone()  # a copy: the next replay overwrites the slot's logits


def _write_positions(cache: Any) -> list[Any]:
    """Each layer's write position (a tensor on transformers 5.2x, where the cache tracks it)."""
    return [layer.cumulative_length.clone() if hasattr(getattr(layer, "cumulative_length", None), "clone")
            else getattr(layer, "cumulative_length", None) for layer in cache.layers]


def _restore_write_positions(cache: Any, positions: list[Any]) -> None:
    for layer, position in zip(cache.layers, positions, strict=True):
        if position is None:
            continue
        if hasattr(position, "clone"):
            layer.cumulative_length.copy_(position)  # in place: the recorded graph reads this tensor
        else:
            layer.cumulative_length = position
