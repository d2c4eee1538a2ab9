"""Training a ``GPTModel`` stage with megatron-core's own machinery (CUDA): its
``DistributedDataParallel`` (gradients in contiguous buffers, reduce-scattered over the
data-parallel group), its distributed optimizer (AdamW whose fp32 state and main parameters are
sharded across the data-parallel ranks; the update is all-gathered back into the parameters), its
gradient clipping over the model-parallel group, and its pipeline schedule
(``get_forward_backward_func``: no pipelining with one stage, 1F1B with several).

The objective is the built-in backend's: the step scales each replica's loss by ``dp`` because
Megatron's DDP averages gradients over the replicas while the loss is already normalised by the
whole batch's tokens. Weight decay applies to every tensor (``config_overrides={}``), as in the
built-in backend; Megatron's default would exempt biases and norms.
"""

from __future__ import annotations

from typing import Any

import torch

from connectors.megatron.batch import MicroBatch
from connectors.megatron.config import MegatronBackendConfig
from connectors.megatron.forward import LossFn, StageForward

ADAM_EPS = 1e-8
"""torch.optim.AdamW's default eps, which the built-in backend uses."""


class MegatronTraining:
    """Megatron-core's DDP, distributed optimizer and pipeline schedule around a ``GPTModel`` stage."""

    def __init__(self, module: torch.nn.Module, config: MegatronBackendConfig, forward: StageForward) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.module = module
        self.forward = forward
        transformer = module.config
        self.model = DistributedDataParallel(
            config=transformer, module=module,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                                     overlap_grad_reduce=False, overlap_param_gather=False))
        transformer.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=config.lr, min_lr=config.lr, weight_decay=config.weight_decay,
                            adam_beta1=config.betas[0], adam_beta2=config.betas[1], adam_eps=ADAM_EPS,
                            clip_grad=config.max_grad_norm, use_distributed_optimizer=True,
                            params_dtype=torch.float32, bf16=False, fp16=False),
            [self.model], config_overrides={})

    def forward_backward(self, micro: MicroBatch, loss_fn: LossFn, *, forward_only: bool) -> dict[str, Any] | None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step_func(batches, model):
            return self.forward(model, next(batches)), loss_fn

        kept = get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=iter([micro]), model=[self.model], num_microbatches=1,
            seq_length=micro.ids.shape[1], micro_batch_size=micro.ids.shape[0], forward_only=forward_only)
        return kept[0] if kept else None

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        _ok, norm, _zeros = self.optimizer.step()
        return float(norm)

    def reload_params(self) -> None:
        """The module's weights were replaced (a resume): refresh the optimizer's main parameters."""
        self.optimizer.reload_model_params()

    def optimizer_state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("megatron connector: the distributed optimizer's state is sharded; a "
                                  "one-rank torch optimizer state cannot be taken from it")

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("megatron connector: the distributed optimizer cannot load a one-rank "
                                  "torch optimizer state")
