"""A batch of trajectories as padded arrays, the layout every trainer backend trains on.

Row ``i`` holds trajectory ``i``'s prompt and response, right-padded with 0; the response positions
``[i, :r]`` carry the position whose logits predict each response token (``gather_pos``), the engine's
log-probs (``behav``) and the loss mask. Filled in numpy and handed to torch once by the caller: a
small torch op per row and column cost more than the rest of the batch's preparation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from astraflow.records import Trajectory


@dataclass
class PackedBatch:
    ids: np.ndarray
    """Token ids ``[B, T]`` (int64)."""
    attn: np.ndarray
    """1 on a row's tokens, 0 on padding ``[B, T]`` (int64)."""
    gather_pos: np.ndarray
    """``[B, R]`` (int64): logits at position p predict token p + 1."""
    behav: np.ndarray
    """The engine's log-probs of the response tokens ``[B, R]`` (float32)."""
    mask: np.ndarray
    """Loss mask ``[B, R]`` (float32; 0 on padding)."""


def pack(trajs: Sequence[Trajectory]) -> PackedBatch:
    """``trajs`` laid out as :class:`PackedBatch`; ValueError for a trajectory whose per-token lists
    (log-probs, loss mask) are not as long as its response."""
    seqs = [list(t.prompt_ids) + list(t.response_ids) for t in trajs]
    n, width = len(trajs), max(len(s) for s in seqs)
    resp_w = max(max(len(t.response_ids) for t in trajs), 1)
    out = PackedBatch(ids=np.zeros((n, width), dtype=np.int64), attn=np.zeros((n, width), dtype=np.int64),
                      gather_pos=np.zeros((n, resp_w), dtype=np.int64),
                      behav=np.zeros((n, resp_w), dtype=np.float32), mask=np.zeros((n, resp_w), dtype=np.float32))
    for i, (t, s) in enumerate(zip(trajs, seqs, strict=True)):
        out.ids[i, : len(s)] = s
        out.attn[i, : len(s)] = 1
        r, p = len(t.response_ids), len(t.prompt_ids)
        if len(t.logprobs) != r or len(t.loss_mask) != r:
            raise ValueError(f"trajectory {getattr(t, 'episode_id', i)}: per-token lengths differ")
        if r:
            out.gather_pos[i, :r] = np.arange(p - 1, p - 1 + r)
            out.behav[i, :r] = t.logprobs
            out.mask[i, :r] = t.loss_mask
    return out
