"""Training: the policy-gradient objective (``objective`` options, ``advantages`` and ``loss``, one step
skeleton ``step``) and substitutable backends (``backend``)."""

from astraflow.trainer.backend import build_backend
from astraflow.trainer.base import TrainerBackend
from astraflow.trainer.config import (
           BackendConfig,
           BaseBackendConfig,
           SimulatedBackendConfig,
           TorchBackendConfig,
)
from astraflow.trainer.loss import group_advantages, policy_loss
from astraflow.trainer.objective import ObjectiveConfig

__all__ = ["BackendConfig", "BaseBackendConfig", "ObjectiveConfig", "SimulatedBackendConfig", "TorchBackendConfig", "TrainerBackend",
           "build_backend", "group_advantages", "policy_loss"]
