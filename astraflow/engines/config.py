"""A recipe's ``engine`` section: one typed options model per engine, chosen by ``type``.

The section is a discriminated union that is open to extension: every engine is registered in
:data:`ENGINES` by name with its options model (a :class:`BaseEngineConfig` whose ``type`` is that
name) and a builder. The built-in ``hf`` and ``simulated`` engines are registered by
``astraflow.engines``; a connector (``connectors/vllm``) or a user's engine registers itself with
:func:`register_engine` in a module the recipe lists under ``imports``. Only options models live
here, so validating a recipe never imports an engine's runtime (torch, vLLM): builders import it
when an engine is built.

    engine: {type: simulated, tokens_per_s: 250, median_tokens: 48}

A misspelt option, a wrong type or an unknown engine is refused when the recipe loads, with the
engine and the option named. ``type`` may be left out: the built-in ``hf`` engine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from statistics import NormalDist
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SerializeAsAny

from astraflow.registry import Builder, PluginConfig, Registry

if TYPE_CHECKING:
    from astraflow.engines.base import Engine


class BaseEngineConfig(PluginConfig):
    """Options every engine has; an engine's own config narrows ``type`` and adds its options."""

    type: str = "hf"
    """Registered name of the engine: "hf" (built-in transformers engine, the default),
    "simulated" (a timing/length SIMULATION for scale experiments), or a connector's name."""
    seed: int = 0
    """Seed of the sampling RNG (a RaaS node adds an offset derived from its id)."""


class HFEngineConfig(BaseEngineConfig):
    """The built-in engine: a ``transformers`` causal LM decoded with a KV cache (``type: hf``)."""

    type: Literal["hf"] = "hf"
    """The built-in Hugging Face engine."""
    device: str = "cpu"
    """Torch device of the engine ("cpu", "cuda", "cuda:1")."""
    max_batch_size: int = Field(default=256, ge=1)
    """Most rows decoded at once (concurrent episodes' requests share the batch; one larger request
    still runs, alone)."""
    batching: Literal["continuous", "request"] = "continuous"
    """How concurrent requests share the engine. "continuous": a request's rows join the running batch
    between two steps and each row leaves the step it ends, as serving engines schedule
    (:mod:`astraflow.engines.continuous`). "request": the requests waiting together run as one batch
    until its longest row ends, later ones waiting for it (:mod:`astraflow.engines.batching`; the
    baseline of benchmarks/node_fill.py). ``decode: static`` always batches per request (its caches
    and compiled step are bucketed per batch), as does ``decode: graphs``."""
    decode: Literal["eager", "static", "graphs"] = "eager"
    """How the decoding steps run. "eager": a dynamic KV cache, each step through Python (on a CPU the
    faster: benchmarks/gpu_rollout.py). "static": transformers' static KV cache of bucketed shape with
    the one-token step compiled by torch.compile, captured as a CUDA graph on a GPU, where an eager
    step is bound by kernel launches (full-attention models; one compile of a minute or more serves
    every batch shape, a 1-row batch one more). Not yet measured on a GPU, so not the default there
    either.
    "graphs": a static KV cache per bucket of rows and the one-token step recorded directly as a CUDA
    graph over the eager forward (milliseconds per bucket, no compile; :mod:`astraflow.engines.graphs`),
    on a CPU run eagerly over the same fixed tensors. Not yet measured on a GPU.
    Log-probs, versions and weight swaps mean the same every way."""
    compile_backend: str = "inductor"
    """torch.compile backend of the static decode step ("inductor"; "aot_eager" or "eager" trace it
    without generating code: for debugging a model that does not compile)."""
    compile_mode: str | None = "reduce-overhead"
    """torch.compile mode of the inductor backend ("reduce-overhead": CUDA graphs; "default";
    "max-autotune"); ignored by other backends."""


class SimulatedEngineConfig(BaseEngineConfig):
    """Timing and length model of the SIMULATED engine (``type: simulated``): no model is run,
    see ``astraflow.engines.simulated``."""

    type: Literal["simulated"] = "simulated"
    """The continuous-batching decode simulator."""
    tokens_per_s: float = Field(default=200.0, gt=0)
    """Decode speed of ONE sequence at speed 1.0 (tokens/s); the node's batch decodes in parallel."""
    speed: float = Field(default=1.0, gt=0)
    """Node speed factor (1.0 = reference hardware, 0.3 = a pool at 30% throughput)."""
    median_tokens: float = Field(default=64.0, gt=0)
    """Median response length (the lognormal's exp(mu))."""
    sigma: float = Field(default=1.0, ge=0)
    """Lognormal shape: p99 = median * exp(2.326 * sigma) (sigma 1.0 -> p99 ~10x the median)."""
    max_tokens: int = Field(default=2048, ge=1)
    """Hard cap on a response (finish_reason "length")."""
    max_batch_size: int = Field(default=256, ge=1)
    """Sequences decoded at once by a node; further requests wait for a free slot."""
    tick_s: float = Field(default=0.02, gt=0)
    """Simulation time step: tokens are produced in chunks of ``tokens_per_s * speed * tick_s``."""
    vocab_size: int = Field(default=31, ge=4)
    """Token ids are drawn from [3, vocab_size) (0-2 are pad/bos/eos)."""
    eos_token_id: int = 2
    """Last token of a response that ends before its cap (finish_reason "stop")."""

    def quantile(self, q: float) -> float:
        """Response-length quantile of the (untruncated) lognormal, e.g. ``quantile(0.99)``."""
        return self.median_tokens * math.exp(self.sigma * NormalDist().inv_cdf(q))

    def draw_length(self, rng: random.Random) -> int:
        """One response length: a lognormal draw, at least 1 and at most ``max_tokens``."""
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(self.median_tokens), self.sigma))))


EngineBuilder = Callable[..., "Engine"]
"""``builder(config, model, *, version) -> Engine``: the engine of ``config`` serving ``model``."""

ENGINES: Registry[Builder] = Registry(
    "engine",
    default=BaseEngineConfig.model_fields["type"].default,
    connectors={"vllm": "connectors.vllm", "vllm-server": "connectors.vllm"},
)
"""Every engine by name: its options model and its builder (:class:`astraflow.registry.Builder`).
Engines shipped as connectors are imported when a recipe names them."""

def register_engine(name: str, config: type[BaseEngineConfig]) -> Callable[[EngineBuilder], EngineBuilder]:
    """Decorator: register ``builder(config, model, *, version) -> Engine`` as engine ``name``
    with options ``config`` (whose ``type`` must be ``Literal[name]``)."""
    return ENGINES.register_builder(name, config)


def parse_engine(data: Any) -> BaseEngineConfig:
    """An engine section (a mapping, a bare name, or options already built) as the named engine's
    options; a mapping without ``type`` names the built-in ``hf`` engine."""
    return ENGINES.parse(data)  # type: ignore[return-value]  # every entry's Config is a BaseEngineConfig


EngineConfig = Annotated[SerializeAsAny[BaseEngineConfig], BeforeValidator(parse_engine)]
"""Pydantic field type of a recipe's engine section: validated into the named engine's options
(:class:`HFEngineConfig`, :class:`SimulatedEngineConfig`, a connector's) and serialised with all
of them."""
