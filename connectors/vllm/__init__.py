"""vLLM as an AstraFlow inference engine: in-process (``engine: {type: vllm}``) or a vLLM server
driven over HTTP (``engine: {type: vllm-server}``); see ``README.md`` here.

Importing this package registers the engine types and their options; vLLM itself is imported only
when an engine is built (:mod:`connectors.vllm.engine`; the server engine needs no vLLM in the
node's Python when it is given a server's URL). ``astraflow.engines`` imports this package by itself
when a recipe names either type, so recipes need no ``imports`` entry for it.
"""

from __future__ import annotations

from typing import Any

from astraflow.engines.config import register_engine
from connectors.vllm.config import VLLMEngineConfig, VLLMServerEngineConfig


@register_engine("vllm", VLLMEngineConfig)
def build_vllm_engine(config: VLLMEngineConfig, model: Any, *, version: int = 0):
    """The vLLM engine serving ``model``'s checkpoint directory (``model.name_or_path``; a model
    without one is saved to a temporary directory first)."""
    from connectors.vllm.engine import VLLMEngine

    return VLLMEngine.from_hf_model(model, config, version=version)


@register_engine("vllm-server", VLLMServerEngineConfig)
def build_vllm_server_engine(config: VLLMServerEngineConfig, model: Any, *, version: int = 0):
    """The engine on a vLLM server: one started for ``model``'s checkpoint, or ``config.url``."""
    from connectors.vllm.server import VLLMServerEngine

    return VLLMServerEngine.from_hf_model(model, config, version=version)


__all__ = ["VLLMEngineConfig", "VLLMServerEngineConfig", "build_vllm_engine", "build_vllm_server_engine"]
