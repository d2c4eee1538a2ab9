"""Training: the GRPO/PPO objective (``loss``) and substitutable backends (``backend``)."""

from astraflow.trainer.backend import BackendConfig, TorchBackend, TrainerBackend, build_backend
from astraflow.trainer.loss import group_advantages, policy_loss

__all__ = ["BackendConfig", "TorchBackend", "TrainerBackend", "build_backend", "group_advantages",
           "policy_loss"]
