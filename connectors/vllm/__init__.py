"""vLLM as an AstraFlow inference engine (``engine: {type: vllm}``): see ``README.md`` here.

Importing this package registers the engine type and its options; vLLM itself is imported only when
an engine is built (:mod:`connectors.vllm.engine`). ``astraflow.engines`` imports this package by
itself when a recipe names ``type: vllm``, so recipes need no ``imports`` entry for it.
"""

from __future__ import annotations

from typing import Any

from astraflow.engines.config import register_engine
from connectors.vllm.config import VLLMEngineConfig


@register_engine("vllm", VLLMEngineConfig)
def build_vllm_engine(config: VLLMEngineConfig, model: Any, *, version: int = 0):
    """The vLLM engine serving ``model``'s checkpoint directory (``model.name_or_path``; a model
    without one is saved to a temporary directory first)."""
    from connectors.vllm.engine import VLLMEngine

    return VLLMEngine.from_hf_model(model, config, version=version)


__all__ = ["VLLMEngineConfig", "build_vllm_engine"]
