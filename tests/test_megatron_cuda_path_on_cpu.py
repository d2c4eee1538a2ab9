"""connectors/megatron's CUDA path (megatron-core's own DistributedDataParallel, distributed optimizer
and pipeline schedules: :mod:`connectors.megatron.megatron_training`) run on CPU ranks with gloo, its
CUDA allocations redirected to the CPU, against the one-rank reference.

What this is, honestly: megatron-core 0.16 allocates its gradient buffers, optimizer scalars,
pipeline receive buffers and schedule counters on ``torch.cuda.current_device()`` /
``device="cuda"``, and checks ``param.type() == "torch.cuda.FloatTensor"``; on a torch without CUDA it
fails before any arithmetic (``AssertionError: Torch not compiled with CUDA enabled``, from
``param_and_grad_buffer.py:800`` when DDP is built and from ``schedules.py:596`` in the schedule; the
first test below pins that). Here the worker processes answer those calls with the CPU: a
``TorchFunctionMode`` rewrites a CUDA ``device=`` to the CPU, ``Tensor.cuda()`` is the identity,
``torch.cuda.current_device`` / ``synchronize`` / ``Stream`` are stand-ins, and ``Tensor.type()`` names
a CPU float tensor as its CUDA type. Every line of Megatron's DDP (reduce-scatter of the gradient
buffer over the data-parallel group, the embedding-group all-reduce of a tied model's two copies), of
its distributed optimizer (sharded fp32 AdamW state, the all-gather of the updated parameters), of its
grad clip and of its 1F1B schedule's point-to-point runs, on gloo. It says nothing about CUDA kernels
or NCCL, which no machine here has; it does check that this connector drives Megatron's training
machinery correctly: the same log-probs and the same update as one rank.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megatron_helpers import MODELS, _check_group, _run_group

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="needs megatron-core (`pip install 'astraflow[megatron]'`)"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real path"),
]


def test_megatrons_ddp_and_schedule_need_cuda_on_this_host():
    """Why the CPU path (connectors/megatron/torch_training.py) exists: the real error, unredirected."""
    from connectors.megatron.backend import MegatronBackend
    from connectors.megatron.megatron_training import MegatronTraining

    backend = MegatronBackend(MODELS["qwen2"](), {"type": "megatron"})
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        MegatronTraining(backend.model, backend.config, backend.training.forward)


@pytest.mark.parametrize("world,make,options", [
    (2, "qwen2", {}),
    (2, "qwen2", {"tensor_parallel": 2}),
    (2, "qwen2", {"pipeline_parallel": 2}),  # tied: the embedding-group all-reduce
    (2, "llama", {"pipeline_parallel": 2}),
], ids=["dp2", "tp2", "pp2-tied", "pp2-untied"])
def test_megatrons_distributed_optimizer_and_schedules_step_as_one_rank(tmp_path, world, make, options):
    reports = _run_group(tmp_path, world, make, options, redirect_cuda=True)
    _check_group(tmp_path, reports, make, world)
