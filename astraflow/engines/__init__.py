"""Inference engines behind one contract; ``build_engine`` switches on ``type``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.engines.simulated import SimulatedEngineConfig


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["hf", "simulated"] = "hf"
    """Which engine: "hf" (built-in transformers engine), "simulated" (a timing/length SIMULATION
    for scale experiments, see ``astraflow.engines.simulated``). vLLM/SGLang connectors plug in here."""
    device: str = "cpu"
    """Torch device of the engine ("cpu", "cuda", "cuda:1")."""
    max_batch_size: int = 256
    """Most prompts decoded in one merged batch."""
    seed: int = 0
    """Seed of the sampling RNG."""
    simulated: SimulatedEngineConfig = Field(default_factory=SimulatedEngineConfig)
    """Settings of the simulated engine (used only when ``type`` is "simulated")."""


def build_engine(config: EngineConfig | dict, model, *, version: int = 0) -> Engine:
    """An engine of ``config.type`` serving ``model`` (a transformers causal LM)."""
    if isinstance(config, dict):
        config = EngineConfig.model_validate(config)
    if config.type == "hf":
        from astraflow.engines.hf import HFEngine

        return HFEngine(model, device=config.device, version=version, seed=config.seed,
                        max_batch_size=config.max_batch_size)
    if config.type == "simulated":
        from astraflow.engines.simulated import SimulatedEngine

        # The model is not run: the simulation only needs the weight versions it is given.
        return SimulatedEngine(config.simulated, version=version, seed=config.seed)
    raise ValueError(f"unknown engine type {config.type!r}")


__all__ = ["Engine", "EngineConfig", "Generation", "SamplingParams", "build_engine"]
