"""The whole model's weights from the ranks that hold its pieces, and back.

* :func:`gather_to_leader`: every tensor-parallel rank of the first data-parallel replica sends its
  piece to its stage's tensor-parallel rank 0 (``gather`` over the tensor-parallel group), which
  joins them and, on a later stage, sends the whole tensor to global rank 0 over the pipeline group.
  Rank 0 ends with the whole Megatron state dict; the other replicas hold the same weights and take
  no part.
* :func:`broadcast_from_leader`: rank 0's HF state to every rank (each then cuts its own piece).

Tensors only (no pickle): every rank knows every tensor's name and shape from the model's HF
config (:func:`megatron_meta`), so each receive is posted with the right shape.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from connectors.megatron.convert import DecoderShape, hf_to_megatron
from connectors.megatron.parallel import Ranks
from connectors.megatron.shard import VOCAB_KEYS, placement, tp_join, tp_split

LEADER = 0


def megatron_meta(hf_meta: Mapping[str, torch.Tensor], shape: DecoderShape, vocab_rows: int) -> dict[str, torch.Tensor]:
    """The whole-model Megatron tensors, on the ``meta`` device, from HF meta tensors; the vocabulary
    tensors with ``vocab_rows`` rows (padded)."""
    out = {}
    for key, t in hf_to_megatron(hf_meta, shape).items():
        out[key] = torch.empty((vocab_rows, *t.shape[1:]), device="meta") if key in VOCAB_KEYS else t
    return out


def gather_to_leader(local: Mapping[str, torch.Tensor], full_meta: Mapping[str, torch.Tensor], shape: DecoderShape,
                     ranks: Ranks, vocab: int) -> dict[str, torch.Tensor]:
    """The whole Megatron state dict (vocabulary unpadded, fp32 on the CPU) on global rank 0, ``{}``
    elsewhere. Collective over the first data-parallel replica."""
    from megatron.core import parallel_state as ps

    layout = ranks.layout
    if ranks.dp_rank != 0:
        return {}
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    whole: dict[str, torch.Tensor] = {}
    for key, meta in full_meta.items():
        stage, name = placement(key, shape, layout)[0]
        split = tp_split(name)
        if ranks.pp_rank == stage:
            piece = local[name].detach().float().contiguous()
            pieces = None
            if layout.tp > 1:
                pieces = [torch.empty_like(piece) for _ in range(layout.tp)] if ranks.tp_rank == 0 else None
                dist.gather(piece, pieces, group=tp_group, group_dst=0)
            if ranks.tp_rank == 0:
                joined = tp_join(pieces or [piece], split)
                if stage == 0:
                    whole[key] = joined.cpu()
                else:
                    dist.send(joined, group=pp_group, group_dst=0)
        elif ranks.pp_rank == 0 and ranks.tp_rank == 0:
            buf = torch.empty(meta.shape, dtype=torch.float32, device=next(iter(local.values())).device)
            dist.recv(buf, group=pp_group, group_src=stage)
            whole[key] = buf.cpu()
    if dist.get_rank() != LEADER:
        return {}
    return {k: v[:vocab] if k in VOCAB_KEYS else v for k, v in whole.items()}


def broadcast_from_leader(hf: Mapping[str, torch.Tensor] | None, hf_meta: Mapping[str, torch.Tensor],
                          device: torch.device) -> dict[str, torch.Tensor]:
    """Rank 0's HF state (fp32) on every rank; the others pass None. Collective over the world."""
    out = {}
    for key, meta in hf_meta.items():
        if dist.get_rank() == LEADER:
            assert hf is not None
            t = torch.as_tensor(hf[key]).detach().to(device=device, dtype=torch.float32).contiguous()
        else:
            t = torch.empty(meta.shape, dtype=torch.float32, device=device)
        dist.broadcast(t, src=LEADER)
        out[key] = t
    return out
