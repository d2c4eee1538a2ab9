"""Megatron-core's parallel state for one trainer: the process group torch.distributed.run started
(:class:`astraflow.trainer.distributed.RankGroup`), cut by ``initialize_model_parallel`` into
tensor-, pipeline- and data-parallel groups.

Megatron's rank order is ``tp-cp-ep-dp-pp``: tensor-parallel ranks are neighbours, then data-parallel
replicas, then pipeline stages, so global rank = ``tp_rank + tp * (dp_rank + dp * pp_rank)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from connectors.megatron.shard import Layout


@dataclass(frozen=True)
class Ranks:
    """This process's coordinates in Megatron's groups (read from ``parallel_state``)."""

    layout: Layout
    dp: int
    """Data-parallel replicas: world size / (tp * pp)."""
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @classmethod
    def current(cls, layout: Layout) -> Ranks:
        from megatron.core import parallel_state as ps

        return cls(layout=layout, dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def init_parallel(device: torch.device, layout: Layout) -> Ranks:
    """Megatron's parallel state with ``layout``'s tensor / pipeline sizes over the whole process
    group; data parallel takes the rest of the world. Without a launcher (no process group yet) a
    one-rank group is made (gloo on CPU, NCCL on CUDA). An existing parallel state must have the
    same sizes."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (layout.tp * layout.pp):
        raise ValueError(f"megatron connector: {world} ranks cannot hold tensor_parallel={layout.tp} x "
                         f"pipeline_parallel={layout.pp} (the world size must be a multiple of their product)")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (layout.tp, layout.pp):
            raise ValueError(f"megatron connector: Megatron's parallel state is already tp={have[0]}, pp={have[1]}; "
                             f"this backend needs tp={layout.tp}, pp={layout.pp}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    return Ranks.current(layout)
