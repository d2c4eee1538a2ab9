"""The trainer-backend contract: one optimisation step on a batch of trajectories, plus the state
to publish and to checkpoint. The trainer component drives any backend through these members
(the built-in ``TorchBackend``, the simulated one, a Megatron-core connector). How a backend is
chosen and configured in a recipe: ``astraflow.trainer.backend``.

A backend may run as a group of ranks (``trainer.ranks`` > 1, launched by torch.distributed.run).
Then ``step``, ``state_dict``, ``load_state``, ``sharded_state`` and ``load_sharded_state`` are
COLLECTIVE: every rank calls them in the same order; only rank 0 reads the log and publishes. The
whole contract (who reads, who publishes, how checkpoints are written) is in
:mod:`astraflow.trainer.distributed`; with one rank every call is local and nothing else changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from astraflow.records import Trajectory


@dataclass
class ShardedState:
    """A backend's checkpoint state as torch.distributed.checkpoint (DCP) saves and loads it."""

    tensors: dict[str, Any]
    """Nested dicts whose leaves are tensors: this rank's shards as DTensors on a rank group, whole
    tensors on one rank. Conventionally ``{"model": {hf_name: tensor}, "optimizer": {hf_name:
    {"exp_avg": ..., "step": ...}}}``. DCP writes each rank's shards and, on a resume, reads into
    these very tensors (resharding when the checkpoint's world size differs)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """The rest, identical on every rank (optimizer param groups, ...): numbers, strings, lists,
    tuples and dicts only; kept in the checkpoint as JSON."""


@dataclass
class WeightRows:
    """This rank's rows of the weights, published as its part of each version (no gather,
    :mod:`astraflow.delta.parts`)."""

    tensors: dict[str, Any]
    """HF name -> CPU copies of this rank's rows ``[lo, hi)`` of dim 0 (the caller owns them); tensors
    with no rows here are left out."""
    rows: dict[str, tuple[int, int]]
    """HF name -> the rows ``[lo, hi)`` of its dim 0 in :attr:`tensors`."""
    shapes: dict[str, list[int]]
    """Every tensor's whole shape (the same on every rank)."""


class TrainerBackend(ABC):
    """What the trainer component needs from a training runtime."""

    runs_as_rank_group: ClassVar[bool] = False
    """The backend keeps the rank-group contract above (collective calls, full state on rank 0,
    :meth:`sharded_state`); the trainer refuses to start a backend without it on more than one rank."""

    @abstractmethod
    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One update on a batch of trajectories; returns metrics (loss, grad norm, reward, ...).
        On a rank group: every rank gets the whole batch, the backend splits it, and every rank
        returns the same (group-reduced) metrics."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model weights to publish / checkpoint: tensors the caller owns (copies; the next step
        must not write them), which the trainer hands to the publisher without copying again.
        On a rank group: the full weights in HF names on rank 0, ``{}`` on the others."""

    def published_weights(self, dtype: Any, *, on_device: bool = False) -> dict[str, Any]:
        """The weights a version publishes: copies the caller owns, floating tensors cast to ``dtype``
        (the fp32 masters untouched). ``on_device``: the copies may stay on the backend's accelerator,
        where the publisher encodes them (``TrainerSpec.encode_weights_on``); by default on the host.
        On a rank group: rank 0's, ``{}`` on the others."""
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.state_dict().items()}

    @abstractmethod
    def optimizer_state_dict(self) -> dict[str, Any]:
        """Optimizer state to checkpoint (single-rank checkpoints of backends without
        :meth:`sharded_state`)."""

    @abstractmethod
    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        """Resume from full state (a single-rank checkpoint, or weights from the weight store). On a
        rank group: rank 0 passes the state, the others ``{}`` / None, and rank 0's is broadcast."""

    @property
    def publishes_rows(self) -> bool:
        """On a rank group, each rank publishes its own rows (:meth:`weight_rows`) as its part of each
        version, so no rank gathers the model. False, the default: the leader publishes
        :meth:`state_dict`'s gathered weights whole."""
        return False

    def weight_rows(self, dtype: Any = None, *, on_device: bool = False) -> WeightRows:
        """This rank's rows of the weights, cast to ``dtype`` (COLLECTIVE on a rank group; only called
        when :attr:`publishes_rows`); ``on_device`` as in :meth:`published_weights`."""
        raise NotImplementedError(f"{type(self).__name__} publishes its weights whole")

    @property
    def wants_reference(self) -> bool:
        """Whether the backend's objective needs the frozen reference policy (a KL term): the trainer
        then hands it version 0 with :meth:`set_reference` after its bootstrap."""
        return False

    def set_reference(self, state: dict[str, Any]) -> None:
        """Load the frozen reference policy (HF names; rank 0's state, ``{}`` on the others)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no reference policy")

    def sharded_state(self) -> ShardedState | None:
        """The checkpoint state for DCP, or None: the backend checkpoints through
        :meth:`state_dict` / :meth:`optimizer_state_dict` instead, which only a single rank may do.
        The tensors may be the live ones: the caller saves them before the next step."""
        return None

    def load_sharded_state(self, state: ShardedState) -> None:
        """Resume: ``state`` is what :meth:`sharded_state` returned, its tensors since loaded in place
        by DCP and its ``extras`` those of the checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} has no sharded (DCP) checkpoint state")
