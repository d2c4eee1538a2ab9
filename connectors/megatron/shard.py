"""A whole Megatron ``GPTModel`` state dict cut into the pieces each tensor / pipeline parallel rank
holds: the HF <-> Megatron conversion of :mod:`connectors.megatron.convert`,
sharded the way megatron-core's parallel layers shard their weights.

Pure tensor re-arrangement (no Megatron import, no process group): the tests put the pieces back
together bit for bit (``tests/megatron_helpers.py``). How Megatron's local layer spec splits a decoder across ``tp`` tensor-parallel ranks:

* ``ColumnParallelLinear`` (``linear_qkv`` weight and bias, ``output_layer``) and
  ``VocabParallelEmbedding`` keep rows ``[r * n / tp, (r + 1) * n / tp)``. The fused QKV rows are
  grouped per query group (convert.py), so rank ``r`` holds whole query groups;
* the gated ``linear_fc1`` = ``[gate; up]`` keeps ``[gate_r; up_r]``: the activation splits the
  rank's rows in two, so each rank must hold its slice of both halves;
* ``RowParallelLinear`` (``linear_proj``, ``linear_fc2``) keeps columns ``r``;
* norms are replicated.

Across ``pp`` pipeline stages, stage ``s`` holds layers ``[s * L / pp, (s + 1) * L / pp)``
renumbered from 0 (Megatron's even split), the embedding on the first stage, the final norm and the
output layer on the last. A tied model with ``pp > 1`` has a copy of the embedding on the last stage
as its ``output_layer.weight`` (Megatron keeps the two equal by summing their gradients).

The vocabulary is padded to a multiple of ``tp`` (Megatron needs equal partitions); padded rows are
zero and never looked up, and :mod:`connectors.megatron.logprobs` keeps their logits out of the
softmax.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from connectors.megatron.convert import DecoderShape

Split = Literal["rows", "cols", "gated_rows"] | None
"""How one tensor is cut across tensor-parallel ranks (None: every rank has all of it)."""

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER = "decoder.layers."


@dataclass(frozen=True)
class Layout:
    """Tensor- and pipeline-parallel sizes of one model replica."""

    tp: int = 1
    pp: int = 1

    def check(self, shape: DecoderShape) -> None:
        """Refuse, naming the numbers, a layout Megatron cannot split ``shape`` into."""
        if shape.groups % self.tp or shape.heads % self.tp:
            raise ValueError(f"megatron connector: tensor_parallel={self.tp} must divide the attention heads "
                             f"({shape.heads}) and the key/value heads ({shape.groups})")
        if shape.layers % self.pp:
            raise ValueError(f"megatron connector: pipeline_parallel={self.pp} must divide the layers "
                             f"({shape.layers})")

    def padded_vocab(self, vocab: int) -> int:
        return -(-vocab // self.tp) * self.tp

    def stage_of_layer(self, layer: int, layers: int) -> tuple[int, int]:
        """(pipeline stage, index within the stage) of global layer ``layer``."""
        per_stage = layers // self.pp
        return layer // per_stage, layer % per_stage


def tp_split(key: str) -> Split:
    """How Megatron's local spec splits ``key`` across tensor-parallel ranks."""
    if key in VOCAB_KEYS or key.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
        return "rows"
    if key.endswith("mlp.linear_fc1.weight"):
        return "gated_rows"
    if key.endswith(("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")):
        return "cols"
    return None


def placement(key: str, shape: DecoderShape, layout: Layout) -> list[tuple[int, str]]:
    """The (pipeline stage, stage-local name) of each copy of the whole-model tensor ``key``: one,
    except a tied embedding with ``pp > 1``, which the last stage holds again as its output layer."""
    last = layout.pp - 1
    if key.startswith(_LAYER):
        layer, rest = key[len(_LAYER):].split(".", 1)
        stage, local = layout.stage_of_layer(int(layer), shape.layers)
        return [(stage, f"{_LAYER}{local}.{rest}")]
    if key == "embedding.word_embeddings.weight":
        return [(0, key)] + ([(last, "output_layer.weight")] if shape.tied and last > 0 else [])
    if key.startswith(("decoder.final_layernorm", "output_layer")):
        return [(last, key)]
    raise KeyError(f"megatron connector: no pipeline placement for {key!r}")


def whole_name(local: str, stage: int, shape: DecoderShape, layout: Layout) -> str | None:
    """The whole-model name of stage ``stage``'s tensor ``local`` (None: the last stage's copy of a
    tied embedding, which is the first stage's tensor)."""
    if local.startswith(_LAYER):
        layer, rest = local[len(_LAYER):].split(".", 1)
        return f"{_LAYER}{stage * (shape.layers // layout.pp) + int(layer)}.{rest}"
    if local == "output_layer.weight" and shape.tied:
        return None
    return local


def _pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def tp_piece(t: torch.Tensor, split: Split, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``t`` (a copy)."""
    if split is None or tp == 1:
        return t.clone()
    if split == "rows":
        return t.chunk(tp, dim=0)[rank].clone()
    if split == "cols":
        return t.chunk(tp, dim=1)[rank].clone()
    gate, up = t.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])


def tp_join(pieces: list[torch.Tensor], split: Split) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's piece, in rank order."""
    if split is None or len(pieces) == 1:
        return pieces[0]
    if split == "rows":
        return torch.cat(pieces, dim=0)
    if split == "cols":
        return torch.cat(pieces, dim=1)
    halves = [p.chunk(2, dim=0) for p in pieces]
    return torch.cat([*(g for g, _ in halves), *(u for _, u in halves)])


def shard(full: Mapping[str, torch.Tensor], shape: DecoderShape, layout: Layout, vocab: int, *,
          tp_rank: int, stage: int) -> dict[str, torch.Tensor]:
    """The stage-local state dict of tensor-parallel rank ``tp_rank`` on pipeline stage ``stage``,
    from a whole-model Megatron state dict (:func:`connectors.megatron.convert.hf_to_megatron`)."""
    layout.check(shape)
    padded = layout.padded_vocab(vocab)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in full.items():
        for where, local in placement(key, shape, layout):
            if where == stage:
                t = _pad_vocab(tensor, padded) if key in VOCAB_KEYS else tensor
                out[local] = tp_piece(t, tp_split(local), tp_rank, layout.tp)
    return out
