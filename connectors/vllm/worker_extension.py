"""AstraFlow's methods on a vLLM server's workers: fetch a version of the weights, then load it.

A server started with ``--worker-extension-cls connectors.vllm.worker_extension.AstraFlowWorker``
has these methods mixed into its worker class; the node calls them through the server's
``/collective_rpc`` route (``VLLM_SERVER_DEV_MODE=1``) with one JSON string argument and gets JSON
back, so nothing is pickled on the wire (``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off).

A refresh is two calls, so that the server decodes while the weights are fetched:

* ``astraflow_fetch(request)`` starts bringing the worker's own copy of the weights to the requested
  version on a thread of its own and returns at once; repeated with the same request it reports
  ``fetching``, ``ready`` or ``failed`` (with the error). From the run's bucket the worker pulls
  with a :class:`~astraflow.delta.WeightSubscriber` of its own (the nearest anchor plus deltas, the
  subscriber's copy kept for the next delta); from a file it reads a safetensors file.
* ``astraflow_apply(request)``, sent while generation is paused, reloads the fetched state into the
  model (:func:`~connectors.vllm.reload.reload_full_state`, as the in-process engine does).

This module imports neither torch nor vLLM at import time: vLLM imports it to build its worker class.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PROTOCOL = 1
"""Version of these requests; ``astraflow_info`` reports it so a node refuses a server that runs
another version of this module."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BucketSource(_Message):
    """A policy's published weights in a run's bucket."""

    kind: Literal["bucket"] = "bucket"
    run: str
    """The run whose ``<run>/weights/<policy>/`` the worker reads."""
    policy: str
    """The policy whose versions are pulled."""
    subscriber: str
    """Id the worker registers its version under in the bucket (the node's id: the weight store's
    GC then keeps the chain the node is on)."""
    bucket: dict[str, Any] | None = None
    """The node's ``s3`` and ``region`` settings (``ClusterConfig`` fields), sent to a server the node
    started itself on loopback; None: the server's own cluster config (``ASTRAFLOW_CONFIG`` /
    ``ASTRAFLOW_S3_*``)."""


class FileSource(_Message):
    """A safetensors file the server can read (transformers names)."""

    kind: Literal["file"] = "file"
    path: str


class FetchRequest(_Message):
    """Bring the worker's copy of the weights to ``version`` from ``source``."""

    version: int
    source: Annotated[BucketSource | FileSource, Field(discriminator="kind")]


class ApplyRequest(_Message):
    """Load the fetched ``version`` into the model (generation is paused)."""

    version: int


class FetchStatus(_Message):
    """Where a fetch stands: ``ready`` once the worker holds ``version``."""

    state: Literal["fetching", "ready", "failed"]
    version: int
    bytes: int = 0
    """Bytes read to get there (the bucket's objects, or the file)."""
    fetch_s: float = 0.0
    """Seconds the fetch took (the pull and decode, or reading the file)."""
    error_type: str | None = None
    """Class name of the error of a failed fetch (``NoPathError``: no path avoids refused objects)."""
    error: str | None = None


class _Fetcher:
    """A worker's fetched weights: one fetch at a time, on a thread of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._source: BucketSource | FileSource | None = None
        self._subscriber: Any = None
        self._status: FetchStatus | None = None
        self._state: dict[str, torch.Tensor] | None = None

    def fetch(self, req: FetchRequest) -> FetchStatus:
        with self._lock:
            st = self._status
            if st is not None and st.version == req.version and self._source == req.source:
                if st.state == "failed":
                    self._status = None  # reported once: the next request tries again
                return st
            if self._thread is not None and self._thread.is_alive():  # another version's fetch: wait for it
                return FetchStatus(state="fetching", version=st.version if st else req.version)
            if self._source != req.source and self._subscriber is not None:
                self._subscriber.close(unregister=False)
                self._subscriber = None
            self._source = req.source
            self._status = FetchStatus(state="fetching", version=req.version)
            self._thread = threading.Thread(target=self._run, args=(req,), name="astraflow-fetch", daemon=True)
            self._thread.start()
            return self._status

    def take(self, version: int) -> dict[str, torch.Tensor]:
        """The fetched state at ``version``; raises when it was not fetched (first ``astraflow_fetch``)."""
        with self._lock:
            st = self._status
            if st is None or st.state != "ready" or st.version != version or self._state is None:
                have = "nothing" if st is None else f"v{st.version} ({st.state})"
                raise RuntimeError(f"astraflow_apply v{version}: the worker holds {have}; fetch it first")
            state = self._state
            if isinstance(self._source, FileSource):
                self._state = None  # a file is read once; a subscriber's copy is the base of its next delta
                self._status = None
            return state

    def _run(self, req: FetchRequest) -> None:
        t0 = time.perf_counter()
        try:
            state, nbytes = self._pull(req) if isinstance(req.source, BucketSource) else self._read(req.source)
            status = FetchStatus(state="ready", version=req.version, bytes=nbytes, fetch_s=time.perf_counter() - t0)
        except Exception as exc:  # reported to the node by the next astraflow_fetch
            log.exception("astraflow: fetching v%d failed", req.version)
            state, status = None, FetchStatus(state="failed", version=req.version, error_type=type(exc).__name__,
                                              error=str(exc), fetch_s=time.perf_counter() - t0)
        with self._lock:
            self._state, self._status = state, status

    def _pull(self, req: FetchRequest) -> tuple[dict[str, torch.Tensor], int]:
        from astraflow.delta import WeightStore, WeightSubscriber
        from astraflow.objstore.regional import open_reader

        src = req.source
        assert isinstance(src, BucketSource)
        if self._subscriber is None:
            cfg = _cluster_config(src)
            # As the node's follower reads: a regional replica of the bucket when the config names one.
            store = WeightStore(open_reader(cfg), cfg.run, src.policy)
            self._subscriber = WeightSubscriber(cfg, src.policy, src.subscriber, store=store)
        state, version, pulled = self._subscriber.pull(req.version)
        if version != req.version:
            raise RuntimeError(f"pulled v{version} of {src.policy!r}, not the v{req.version} asked for")
        return state, pulled

    @staticmethod
    def _read(src: FileSource) -> tuple[dict[str, torch.Tensor], int]:
        from pathlib import Path

        from safetensors.torch import load_file

        return load_file(src.path), Path(src.path).stat().st_size


def _cluster_config(src: BucketSource) -> Any:
    """The cluster config to read the bucket with: the settings sent, or the server's own."""
    from astraflow.config import ClusterConfig

    if src.bucket is not None:
        return ClusterConfig.model_validate({**src.bucket, "run": src.run})
    return ClusterConfig.load().model_copy(update={"run": src.run})


class AstraFlowWorker:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); every method takes and returns
    JSON (see the module docstring)."""

    def _astraflow_fetcher(self) -> _Fetcher:
        # A mixin has no constructor of its own: the fetcher is made on first use.
        fetcher = self.__dict__.get("_astraflow_fetcher_obj")
        if fetcher is None:
            fetcher = self.__dict__.setdefault("_astraflow_fetcher_obj", _Fetcher())
        return fetcher

    def astraflow_info(self) -> dict[str, Any]:
        """What the node checks before using the server: this module's protocol and how vLLM reports
        log-probs (it must be ``processed_logprobs``, as the trainer recomputes them), and the device
        its vLLM runs on."""
        from vllm.platforms import current_platform

        model_config = self.model_runner.model_config  # type: ignore[attr-defined]  # the worker's
        return {"protocol": PROTOCOL, "logprobs_mode": str(model_config.logprobs_mode),
                "model": str(model_config.model), "dtype": str(model_config.dtype),
                "device_type": str(current_platform.device_type)}

    def astraflow_fetch(self, request: str) -> dict[str, Any]:
        """Start (or report on) fetching a version; see :class:`FetchRequest` / :class:`FetchStatus`."""
        return self._astraflow_fetcher().fetch(FetchRequest.model_validate_json(request)).model_dump()

    def astraflow_apply(self, request: str) -> dict[str, Any]:
        """Reload the fetched version into the model; generation must be paused."""
        from connectors.vllm.reload import reload_full_state

        req = ApplyRequest.model_validate_json(request)
        state = self._astraflow_fetcher().take(req.version)
        t0 = time.perf_counter()
        reload_full_state(self, state.items())
        return {"version": req.version, "reload_s": time.perf_counter() - t0}
