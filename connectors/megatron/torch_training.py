"""Training a ``GPTModel`` split over tensor, pipeline and data-parallel ranks with torch.distributed's
point-to-point calls and collectives and torch's AdamW: where megatron-core's own training machinery
cannot run (CPU with gloo), and on one GPU, where it has nothing to distribute.

megatron-core 0.16's ``DistributedDataParallel`` (its gradient buffers), its distributed optimizer,
its gradient clipping and its pipeline schedules (even the one without pipelining) allocate on
``torch.cuda.current_device()`` / ``device="cuda"`` unconditionally, so on a host without CUDA they
fail before any arithmetic. The model, its tensor-parallel layers and collectives, the vocab-parallel
loss and the parallel state are Megatron's here as on a GPU; what this module does instead, with the
same semantics as :mod:`connectors.megatron.megatron_training`:

* one micro-batch per replica through the stages (forward down the pipeline, backward up, the
  activations and their gradients sent stage to stage);
* gradients averaged over the data-parallel group (as Megatron's DDP does; the step scales the loss
  by ``dp``);
* the global gradient norm over the model-parallel group, counting a replicated tensor (norms) once
  per tensor-parallel group (Megatron's ``param_is_not_tensor_parallel_duplicate``), and the
  built-in backend's clip;
* torch AdamW on each rank's shard (Adam is element-wise, so a shard's update is the whole tensor's
  update restricted to the shard). The optimizer state is replicated across data-parallel ranks,
  not sharded as Megatron's distributed optimizer shards it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from connectors.megatron.batch import MicroBatch
from connectors.megatron.config import MegatronBackendConfig
from connectors.megatron.forward import LossFn, StageForward
from connectors.megatron.parallel import Ranks


class TorchTraining:
    """Forward/backward, gradient reduction and AdamW for a ``GPTModel`` stage (gloo or NCCL)."""

    def __init__(self, module: torch.nn.Module, config: MegatronBackendConfig, forward: StageForward) -> None:
        self.module = module
        self.config = config
        self.forward = forward
        self.ranks: Ranks = forward.ranks
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)

    def forward_backward(self, micro: MicroBatch, loss_fn: LossFn, *, forward_only: bool) -> dict[str, Any] | None:
        """One micro-batch through this rank's stage; what ``loss_fn`` kept on the last stage."""
        from megatron.core import parallel_state as ps

        r = self.ranks
        hidden = (micro.ids.shape[1], micro.ids.shape[0], self.module.config.hidden_size)
        device = micro.ids.device
        received = None
        if not r.first_stage:
            received = torch.empty(hidden, dtype=torch.float32, device=device)
            dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
            received.requires_grad_(not forward_only)
            self.module.set_input_tensor(received)
        out = self.forward(self.module, micro)
        kept = None
        if r.last_stage:
            loss, kept = loss_fn(out)
            if not forward_only:
                loss.backward()
        else:
            dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            if not forward_only:
                grad = torch.empty(hidden, dtype=torch.float32, device=device)
                dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
                out.backward(grad)
        if received is not None and not forward_only:
            dist.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
        return kept

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        """Average the gradients over the replicas, clip by the global norm, step; the norm."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.ranks.dp > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            flat /= self.ranks.dp
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(g.view_as(p.grad))
        own = [p.grad for p in params if param_is_not_tensor_parallel_duplicate(p)]
        device = params[0].device
        square = sum((g.double().square().sum() for g in own), torch.zeros((), dtype=torch.float64, device=device))
        dist.all_reduce(square, group=ps.get_model_parallel_group())
        norm = float(square.sqrt())
        # torch.nn.utils.clip_grad_norm_'s rule, so that one rank clips exactly as the built-in backend.
        coef = self.config.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        self.optimizer.step()
        return norm

    def reload_params(self) -> None:
        """Nothing to do: AdamW steps the module's own parameters."""

    def optimizer_state_dict(self) -> dict[str, Any]:
        import copy

        return copy.deepcopy(self.optimizer.state_dict())

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        import copy

        self.optimizer.load_state_dict(copy.deepcopy(state))
