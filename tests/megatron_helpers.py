"""Test helpers of the Megatron connector: a sharded state put back together (the inverse of
:func:`connectors.megatron.shard.shard`), to check that sharding loses nothing."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from connectors.megatron.convert import DecoderShape
from connectors.megatron.shard import VOCAB_KEYS, Layout, tp_join, tp_split, whole_name


def unshard(stages: list[list[Mapping[str, torch.Tensor]]], shape: DecoderShape, layout: Layout,
            vocab: int) -> dict[str, torch.Tensor]:
    """The whole-model state dict from ``stages[s][r]``, the state of tensor-parallel rank ``r`` on
    stage ``s`` (the inverse of :func:`shard`; the last stage's tied copy is left out)."""
    out: dict[str, torch.Tensor] = {}
    for s, ranks in enumerate(stages):
        for local in ranks[0]:
            key = whole_name(local, s, shape, layout)
            if key is None or local.endswith("_extra_state"):
                continue
            whole = tp_join([r[local] for r in ranks], tp_split(local))
            out[key] = whole[:vocab] if key in VOCAB_KEYS else whole
    return out
