"""Options of the Megatron-core trainer backend (``backend: {type: megatron, ...}`` in a recipe).

This module imports neither Megatron nor torch: validating a recipe that names ``megatron`` only
checks that ``megatron.core`` can be found and refuses the recipe, naming the package to install,
when it cannot.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from astraflow.trainer.config import TorchBackendConfig

INSTALL_HINT = ("the 'megatron' trainer backend needs megatron-core, which this Python does not have: "
                "install it with `pip install 'astraflow[megatron]'` (or `pip install megatron-core`)")


def megatron_available() -> bool:
    """Whether ``import megatron.core`` would find the package. Nothing is imported: ``find_spec``
    of a submodule would import its parent package, so the ``core`` folder is looked up instead."""
    spec = importlib.util.find_spec("megatron")
    return spec is not None and any((Path(p) / "core").is_dir() for p in spec.submodule_search_locations or [])


class MegatronBackendConfig(TorchBackendConfig):
    """GRPO/PPO on a Megatron-core ``GPTModel`` converted from the policy's HF checkpoint
    (``type: megatron``). The objective and optimiser options are the built-in backend's (same
    names, same meaning); the published weights carry HF names, so engines never know which backend
    trained them. Under ``trainer.ranks`` > 1 the model is split ``tensor_parallel`` x
    ``pipeline_parallel`` ways and the remaining factor of the world size is data parallel; see
    connectors/megatron/README.md."""

    type: Literal["megatron"] = "megatron"  # type: ignore[assignment]  # narrows the parent's "torch"
    """The Megatron-core connector (``connectors/megatron``)."""
    tensor_parallel: int = Field(default=1, ge=1)
    """Ranks each layer's weights are split across (Megatron's tensor model parallel size); it must
    divide the attention heads and the key/value heads."""
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline stages the layers are split into (Megatron's pipeline model parallel size); it must
    divide the layers."""
    distributed_optimizer: bool = False
    """Train with megatron-core's own machinery: its DistributedDataParallel, its distributed optimizer
    (AdamW state sharded over the data-parallel ranks) and its pipeline schedules. They need CUDA, and
    this connector cannot checkpoint the distributed optimizer's state yet (a run with it fails at its
    first checkpoint). False: torch collectives and torch AdamW on each rank's shard, replicated over
    the data-parallel ranks, checkpointed through DCP (the path CPU runs take). Needed for a model with
    tied embeddings split into pipeline stages."""

    @model_validator(mode="after")
    def _megatron_installed(self) -> MegatronBackendConfig:
        if not megatron_available():
            raise ValueError(INSTALL_HINT)
        if self.objective.kl is not None and self.pipeline_parallel > 1:
            raise ValueError("megatron connector: objective.kl (a frozen reference policy) needs pipeline_parallel: 1; "
                             "the reference is forwarded on one stage")
        if self.distributed_optimizer and not self.device.startswith("cuda"):
            raise ValueError("megatron connector: distributed_optimizer needs a CUDA device (megatron-core's "
                             "DDP buffers, distributed optimizer and schedules allocate on CUDA)")
        return self
