"""Inference engines behind one contract; ``build_engine`` switches on ``type``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from astraflow.engines.base import Engine, Generation, SamplingParams


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["hf"] = "hf"
    """Which engine: "hf" (built-in transformers engine). vLLM/SGLang connectors plug in here."""
    device: str = "cpu"
    """Torch device of the engine ("cpu", "cuda", "cuda:1")."""
    max_batch_size: int = 256
    """Most prompts decoded in one merged batch."""
    seed: int = 0
    """Seed of the sampling RNG."""


def build_engine(config: EngineConfig | dict, model, *, version: int = 0) -> Engine:
    """An engine of ``config.type`` serving ``model`` (a transformers causal LM)."""
    if isinstance(config, dict):
        config = EngineConfig.model_validate(config)
    if config.type == "hf":
        from astraflow.engines.hf import HFEngine

        return HFEngine(model, device=config.device, version=version, seed=config.seed,
                        max_batch_size=config.max_batch_size)
    raise ValueError(f"unknown engine type {config.type!r}")


__all__ = ["Engine", "EngineConfig", "Generation", "SamplingParams", "build_engine"]
