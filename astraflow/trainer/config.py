"""A recipe's ``backend`` section (per policy): one typed options model per trainer backend, chosen
by ``type``.

The section is a discriminated union open to extension: every backend is registered in
:data:`BACKENDS` by name with its options model (a :class:`BaseBackendConfig` whose ``type`` is that
name) and a builder. ``torch`` and ``simulated`` are registered by :mod:`astraflow.trainer.backend`
(imported with the package); a connector (``connectors/megatron``) or a user's backend registers itself
with :func:`register_backend` in a module the recipe lists under ``imports``. Only options models live
here, so validating a recipe never imports a backend's runtime (torch): builders import it when a
backend is built.

    backend: {type: torch, lr: 1.0e-3, clip_eps: 0.2}          # type may be left out: torch
    backend: {lr: 1.0e-3, objective: {advantage: rloo, kl: {coef: 0.05}}}
    backend: {type: simulated, step_base_s: 0.25, params: 65536}

A misspelt option, a wrong type or an unknown backend is refused when the recipe loads, with the
backend and the option named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SerializeAsAny

from astraflow.registry import Builder, PluginConfig, Registry
from astraflow.trainer.objective import ObjectiveConfig

if TYPE_CHECKING:
    from astraflow.trainer.base import TrainerBackend


class BaseBackendConfig(PluginConfig):
    """Options every trainer backend has; a backend's own config narrows ``type`` and adds its own."""

    type: str = "torch"
    """Registered name of the backend: "torch" (built-in PyTorch on a transformers model, the
    default), "simulated" (a step-time SIMULATION for scale experiments), or a connector's name."""


class TorchBackendConfig(BaseBackendConfig):
    """Optimiser and objective hyper-parameters of the built-in PyTorch backend (``type: torch``)."""

    type: Literal["torch"] = "torch"
    """GRPO/PPO with AdamW on the policy's ``transformers`` model."""
    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    clip_eps: float = Field(default=0.2, gt=0)
    """PPO ratio clip (lower side, and upper side unless clip_eps_high is set)."""
    clip_eps_high: float | None = Field(default=None, gt=0)
    """Upper PPO clip ("clip-higher"); None = clip_eps."""
    is_cap: float = Field(default=2.0, gt=0)
    """Truncation of the importance weight pi_proximal / pi_behaviour for stale tokens."""
    adv_eps: float = Field(default=1e-6, ge=0)
    """Added to the group std when normalising advantages."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the engines: logits are divided by it, so log-probs match."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per batch (>1 makes the PPO clip active against the proximal policy)."""
    skip_zero_advantage: bool = True
    """Leave out of the forward and backward the trajectories whose advantage is 0 (every sample of
    their group got the same reward: often half a GRPO batch). Their loss terms are exactly 0, and the
    loss keeps the whole batch's token count as its denominator, so the update is the same; only the
    diagnostics (clip and importance-weight fractions, ``behav_kl``) then cover the trained
    trajectories alone (``entropy``, ``kl_ref`` too). An objective with terms that do not vanish with the
    advantage (an entropy bonus, a KL loss term) trains every row whatever this says."""
    step_without_signal: bool = False
    """Whether a minibatch in which every advantage is 0 (and whose objective has no term besides the
    advantage's) still steps the optimizer. Off by default: its gradient is exactly 0, but Adam would
    still move every weight along its momentum, step after step while the batches carry no signal. On
    the math recipe that drift pushed a policy off a cliff: no response ended within
    ``max_new_tokens``, the reward went to 0 for good (docs/results.md, "Learning across seeds")."""
    device: str = "cpu"
    """Torch device of the trained model."""
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    """The policy-gradient objective: advantage estimator, loss aggregation, KL to a frozen reference,
    entropy bonus, dual clip, overlong penalty (:class:`~astraflow.trainer.objective.ObjectiveConfig`;
    the default is GRPO with a token-mean loss)."""


class SimulatedBackendConfig(BaseBackendConfig):
    """Step-time model and published tensors of the SIMULATED backend (``type: simulated``): no
    gradient is computed, see ``astraflow.trainer.simulated``."""

    type: Literal["simulated"] = "simulated"
    """The step-time simulator (real, small published tensors)."""
    step_base_s: float = Field(default=0.2, ge=0)
    """Fixed seconds per step (optimizer, collectives)."""
    step_s_per_token: float = Field(default=2e-4, ge=0)
    """Seconds per trained (loss-masked) token: the step time scales with batch tokens."""
    params: int = Field(default=65_536, ge=1)
    """Parameters of the one published tensor (bf16): small, real, changed every step."""
    changed_fraction: float = Field(default=0.01, gt=0, le=1)
    """Fraction of parameters changed per step (real RL steps change ~0.5-1.5% of bf16 weights)."""
    seed: int = 0
    """Seed of the initial tensor and of which entries change."""


BackendBuilder = Callable[[Any, Any], "TrainerBackend"]
"""``builder(config, model) -> TrainerBackend``: the backend of ``config`` training ``model``."""

BACKENDS: Registry[Builder] = Registry(
    "trainer backend",
    default=BaseBackendConfig.model_fields["type"].default,
    connectors={"megatron": "connectors.megatron"},
)
"""Every trainer backend by name: its options model and its builder
(:class:`astraflow.registry.Builder`). Backends shipped as connectors are imported when a recipe
names them."""

def register_backend(name: str, config: type[BaseBackendConfig]) -> Callable[[BackendBuilder], BackendBuilder]:
    """Decorator: register ``builder(config, model) -> TrainerBackend`` as backend ``name`` with
    options ``config`` (whose ``type`` must be ``Literal[name]``)."""
    return BACKENDS.register_builder(name, config)


def parse_backend(data: Any) -> BaseBackendConfig:
    """A backend section (a mapping, a bare name, or options already built) as the named backend's
    options; a mapping without ``type`` names the built-in ``torch`` backend."""
    return BACKENDS.parse(data)  # type: ignore[return-value]  # every entry's Config is a BaseBackendConfig


BackendConfig = Annotated[SerializeAsAny[BaseBackendConfig], BeforeValidator(parse_backend)]
"""Pydantic field type of a recipe's backend section: validated into the named backend's options
(:class:`TorchBackendConfig`, :class:`SimulatedBackendConfig`, a connector's) and serialised with
all of them."""
