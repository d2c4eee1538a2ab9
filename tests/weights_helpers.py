"""Weights split into parts as a rank group's FSDP2 shards split them, for the tests of versions in parts."""

from __future__ import annotations

import torch

from astraflow.delta.parts import Rows, chunk_rows, row_view


def shard_rows(state: dict[str, torch.Tensor], index: int, parts: int) -> tuple[dict[str, torch.Tensor], Rows]:
    """Part ``index`` of ``parts`` of a whole state split as FSDP2 splits it (tensors without rows in
    this part left out): the row views and their spans."""
    views, rows = {}, {}
    for name, t in state.items():
        span = chunk_rows(t.shape[0] if t.dim() else 1, index, parts)
        if span[1] > span[0]:
            views[name], rows[name] = row_view(t, span), span
    return views, rows
