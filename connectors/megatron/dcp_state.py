"""The Megatron backend's weights and AdamW moments as torch.distributed.checkpoint (DCP) state: each
rank's pieces as DTensor shards of the WHOLE Megatron tensors, so a checkpoint written under one
layout (tp, pp, dp, world size) loads under another, DCP reading the slices each rank needs.

* names: whole-model Megatron names (global layer indices); the last stage's copy of a tied
  embedding is left out (it is the first stage's tensor);
* the device mesh is ``(pp, dp, tp)`` over the world, Megatron's rank order; a tensor of stage ``s``
  lives on that stage's ``(dp, tp)`` sub-mesh: replicated over ``dp``, ``Shard(dim)`` over ``tp`` as
  :mod:`connectors.megatron.shard` splits it, or replicated (norms);
* the gated ``linear_fc1`` (``[gate_r; up_r]`` on rank r, not one slice of ``[gate; up]``) is two
  entries, ``<name>.gate`` and ``<name>.up``, each a row shard;
* the vocabulary's padding rows are left out: the last tensor-parallel rank's piece is cut to the real
  rows, an uneven ``Shard(0)`` of the unpadded tensor (DTensor's chunking: ``ceil(V / tp)`` rows per
  rank, the rest on the last), so the padding, which depends on tp, never reaches the checkpoint.

Every entry is a view of the live parameter or moment: DCP's load writes into the model itself.
With one rank the entries are plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from connectors.megatron.convert import DecoderShape
from connectors.megatron.parallel import Ranks
from connectors.megatron.shard import VOCAB_KEYS, tp_split, whole_name


def _mesh(ranks: Ranks, device: torch.device) -> Any:
    """This stage's ``(dp, tp)`` device mesh (creating the mesh is collective over the world)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = ranks.layout
    mesh = init_device_mesh(device.type, (layout.pp, ranks.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    return mesh["dp", "tp"]


class ShardedEntries:
    """Builds, for one ``GPTModel`` stage, the DCP entries of any tensor shaped like its parameters."""

    def __init__(self, module: torch.nn.Module, ranks: Ranks, shape: DecoderShape, vocab: int,
                 device: torch.device) -> None:
        self.ranks, self.vocab = ranks, vocab
        self.params = {name: p for name, p in module.named_parameters()}
        self.names = {name: whole_name(name, ranks.pp_rank, shape, ranks.layout) for name in self.params}
        world = ranks.layout.tp * ranks.layout.pp * ranks.dp
        self.mesh = _mesh(ranks, device) if world > 1 else None

    def entries(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``{whole name: DTensor}`` of ``tensors`` (keyed like the module's parameters)."""
        out: dict[str, Any] = {}
        for local, tensor in tensors.items():
            name = self.names[local]
            if name is None:
                continue
            split = tp_split(local)
            if split == "gated_rows":
                gate, up = tensor.chunk(2, dim=0)
                out[f"{name}.gate"], out[f"{name}.up"] = self._shard(gate, 0), self._shard(up, 0)
            elif split is None:
                out[name] = self._shard(tensor, None)
            elif name in VOCAB_KEYS:
                out[name] = self._shard(self._unpadded(tensor), 0, rows=self.vocab)
            else:
                out[name] = self._shard(tensor, 1 if split == "cols" else 0)
        return out

    def _unpadded(self, piece: torch.Tensor) -> torch.Tensor:
        per_rank = piece.shape[0]
        real = max(0, min(per_rank, self.vocab - self.ranks.tp_rank * per_rank))
        return piece[:real]

    def _shard(self, local: torch.Tensor, dim: int | None, rows: int | None = None) -> Any:
        if self.mesh is None:
            return local
        from torch.distributed.tensor import DTensor, Replicate, Shard

        tp = self.ranks.layout.tp
        whole = list(local.shape)
        if dim is not None:
            whole[dim] = rows if rows is not None else local.shape[dim] * tp
        placements = [Replicate(), Shard(dim) if dim is not None else Replicate()]
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=torch.Size(whole),
                                  stride=torch.empty(whole, device="meta").stride())


def adam_entries(optimizer: torch.optim.Optimizer, entries: ShardedEntries) -> tuple[dict[str, Any], int]:
    """The AdamW moments as ``{name: {"exp_avg": ..., "exp_avg_sq": ...}}`` and the step count. A
    moment not created yet (no step taken) is created as zeros, the state AdamW's first step starts
    from, so a resume has tensors to load into."""
    by_param = {id(p): name for name, p in entries.params.items()}
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    steps = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            steps.add(int(state["step"]))
            for kind, by_name in moments.items():
                by_name[by_param[id(p)]] = state[kind]
    if len(steps) > 1:
        raise ValueError(f"megatron connector: AdamW parameters at different step counts {sorted(steps)}")
    avg, avg_sq = entries.entries(moments["exp_avg"]), entries.entries(moments["exp_avg_sq"])
    return {n: {"exp_avg": t, "exp_avg_sq": avg_sq[n]} for n, t in avg.items()}, steps.pop() if steps else 0


def set_adam_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p]["step"] = torch.tensor(float(step))
