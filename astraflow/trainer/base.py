"""The trainer-backend contract: one optimisation step on a batch of trajectories, plus the state
to publish and to checkpoint. The trainer component drives any backend through these four members
(the built-in ``TorchBackend``, the simulated one, a Megatron-core connector). How a backend is
chosen and configured in a recipe: ``astraflow.trainer.backend``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.records import Trajectory


class TrainerBackend(ABC):
    """What the trainer component needs from a training runtime."""

    @abstractmethod
    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One update on a batch of trajectories; returns metrics (loss, grad norm, reward, ...)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model weights to publish / checkpoint: tensors the caller owns (copies; the next step
        must not write them), which the trainer hands to the publisher without copying again."""

    @abstractmethod
    def optimizer_state_dict(self) -> dict[str, Any]:
        """Optimizer state to checkpoint."""

    @abstractmethod
    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        """Resume from a checkpoint."""
