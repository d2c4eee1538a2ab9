"""Training: the GRPO/PPO objective (``loss``) and substitutable backends (``backend``)."""

from astraflow.trainer.backend import build_backend
from astraflow.trainer.base import TrainerBackend
from astraflow.trainer.config import (
           BackendConfig,
           BaseBackendConfig,
           SimulatedBackendConfig,
           TorchBackendConfig,
)
from astraflow.trainer.loss import group_advantages, policy_loss

__all__ = ["BackendConfig", "BaseBackendConfig", "SimulatedBackendConfig", "TorchBackendConfig", "TrainerBackend",
           "build_backend", "group_advantages", "policy_loss"]
