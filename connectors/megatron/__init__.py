"""Megatron-core as an AstraFlow trainer backend (``backend: {type: megatron}``): see ``README.md`` here.

Importing this package registers the backend type and its options; Megatron itself is imported only
when a backend is built (:mod:`connectors.megatron.backend`). ``astraflow.trainer.backend`` imports
this package by itself when a recipe names ``type: megatron``, so recipes need no ``imports`` entry.
"""

from __future__ import annotations

from typing import Any

from astraflow.trainer.config import register_backend
from connectors.megatron.config import MegatronBackendConfig


@register_backend("megatron", MegatronBackendConfig)
def build_megatron_backend(config: MegatronBackendConfig, model: Any):
    """The Megatron-core backend training a ``GPTModel`` converted from ``model`` (an HF Qwen2/Llama)."""
    from connectors.megatron.backend import MegatronBackend

    return MegatronBackend(model, config)


__all__ = ["MegatronBackendConfig", "build_megatron_backend"]
