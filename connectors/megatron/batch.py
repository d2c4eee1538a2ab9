"""A batch of trajectories as the tensors one data-parallel rank trains on.

Every rank gets the whole batch (:mod:`astraflow.trainer.distributed`); data-parallel rank ``d`` of
``dp`` takes rows ``d, d + dp, ...`` of a minibatch. The loss is normalised by the whole minibatch's
loss tokens, so the gradients summed over the replicas are the one-rank gradient. A replica left
without a row (fewer trained rows than replicas) forwards one row with a zero loss mask: it still
runs the collectives, and contributes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from astraflow.trainer.packing import pack

if TYPE_CHECKING:
    from astraflow.records import Trajectory


@dataclass
class MicroBatch:
    """One forward/backward's tensors (``B`` rows of width ``T``, ``R`` response positions)."""

    ids: torch.Tensor
    """Token ids ``[B, T]``, right-padded with 0."""
    gather_pos: torch.Tensor
    """``[B, R]``: the position whose logits predict each response token."""
    behav: torch.Tensor
    """The engine's log-probs of the response tokens ``[B, R]``."""
    mask: torch.Tensor
    """Loss mask ``[B, R]`` (0 on padding and on a replica's filler row)."""
    adv: torch.Tensor
    """Advantage per row ``[B]``."""
    batch_tokens: float
    """Loss tokens of the whole minibatch over every replica: the loss's denominator."""
    row_scale: torch.Tensor | None = None
    """Each row's weight under a sequence-mean aggregation ``[B]`` (None: token mean)."""

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.ids.shape[1], device=self.ids.device).expand_as(self.ids)


def replica_rows(rows: Sequence[int], dp_rank: int, dp: int) -> tuple[list[int], bool]:
    """This replica's share of ``rows`` and whether it is a filler (no row of its own)."""
    mine = list(rows[dp_rank::dp])
    return (mine, False) if mine else ([rows[0]], True)


def micro_batch(trajs: Sequence[Trajectory], adv: Sequence[float], batch_tokens: float, device: torch.device, *,
                filler: bool = False, row_scale: Sequence[float] | None = None) -> MicroBatch:
    """The tensors of ``trajs`` (advantages ``adv``, aggregation weights ``row_scale``), as the built-in
    backend lays them out (:func:`astraflow.trainer.packing.pack`); a filler row's loss mask is all 0."""
    b = pack(trajs)
    if filler:
        b.mask[:] = 0.0

    def as_t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return MicroBatch(ids=as_t(b.ids), gather_pos=as_t(b.gather_pos), behav=as_t(b.behav), mask=as_t(b.mask),
                      adv=torch.tensor(list(adv), dtype=torch.float32, device=device), batch_tokens=batch_tokens,
                      row_scale=None if row_scale is None else torch.tensor(
                          [0.0] * len(trajs) if filler else list(row_scale), dtype=torch.float32, device=device))
