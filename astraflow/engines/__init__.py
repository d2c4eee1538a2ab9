"""Inference engines behind one contract (``base``), chosen by a recipe's ``engine.type``
(``config``) and built by :func:`build_engine`, which imports an engine's runtime only then."""

from __future__ import annotations

from typing import Any

from astraflow.engines.base import Engine, Generation, SamplingParams
from astraflow.engines.config import (
    ENGINES,
    BaseEngineConfig,
    EngineConfig,
    HFEngineConfig,
    SimulatedEngineConfig,
    parse_engine,
    register_engine,
)
from astraflow.engines.weight_update import (
    FullState,
    InPlacePatch,
    PublishedVersion,
    UpdateRefusedError,
    WeightUpdate,
)


@register_engine("hf", HFEngineConfig)
def _build_hf(config: HFEngineConfig, model: Any, *, version: int) -> Engine:
    from astraflow.engines.hf import HFEngine

    return HFEngine(model, device=config.device, version=version, seed=config.seed,
                    max_batch_size=config.max_batch_size, batching=config.batching, decode=config.decode,
                    compile_backend=config.compile_backend, compile_mode=config.compile_mode)


@register_engine("simulated", SimulatedEngineConfig)
def _build_simulated(config: SimulatedEngineConfig, model: Any, *, version: int) -> Engine:
    from astraflow.engines.simulated import SimulatedEngine

    # The model is not run: the simulation only needs the weight versions it is given.
    return SimulatedEngine(config, version=version)


def build_engine(config: BaseEngineConfig | dict[str, Any] | str | None, model: Any, *, version: int = 0) -> Engine:
    """The engine named by ``config.type`` serving ``model`` (a transformers causal LM; unused by
    the simulated engine), holding weight ``version``. ``config`` may also be a recipe's engine
    section as a mapping or a bare name; a mapping without ``type`` is the built-in ``hf`` engine."""
    parsed = parse_engine(config)
    return ENGINES.get(parsed.type)(parsed, model, version=version)


__all__ = ["ENGINES", "BaseEngineConfig", "Engine", "EngineConfig", "FullState", "Generation", "HFEngineConfig",
           "InPlacePatch", "PublishedVersion", "SamplingParams", "SimulatedEngineConfig", "UpdateRefusedError",
           "WeightUpdate", "build_engine", "parse_engine", "register_engine"]
