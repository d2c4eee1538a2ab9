"""Building a policy's trainer backend: :func:`build_backend`, and the builders of the built-in ``torch``
and ``simulated`` backends, registered with their options (:mod:`astraflow.trainer.config`). A builder
imports its backend's runtime only when it builds one. The contract is
:class:`astraflow.trainer.base.TrainerBackend`; the implementations are ``torch_backend`` and
``simulated``.
"""

from __future__ import annotations

from typing import Any

from astraflow.trainer.base import TrainerBackend
from astraflow.trainer.config import (
    BACKENDS,
    BaseBackendConfig,
    SimulatedBackendConfig,
    TorchBackendConfig,
    register_backend,
)


@register_backend("torch", TorchBackendConfig)
def _build_torch(config: TorchBackendConfig, model: Any) -> TrainerBackend:
    from astraflow.trainer.torch_backend import TorchBackend

    return TorchBackend(model, config)


@register_backend("simulated", SimulatedBackendConfig)
def _build_simulated(config: SimulatedBackendConfig, model: Any) -> TrainerBackend:
    from astraflow.trainer.simulated import SimulatedBackend

    return SimulatedBackend(config)  # the model is not trained, only its step time simulated


def build_backend(model: Any, config: BaseBackendConfig | dict[str, Any] | str | None = None) -> TrainerBackend:
    """The backend named by ``config.type`` training ``model`` (a transformers causal LM; unused by
    the simulated backend). ``config`` may also be a recipe's backend section as a mapping or a bare
    name; a mapping without ``type`` (or None) is the built-in ``torch`` backend."""
    return BACKENDS.build(config, model)  # type: ignore[no-any-return]  # a Builder returns Any
