"""The Megatron-core trainer backend: the built-in backend's objective and step skeleton
(:mod:`astraflow.trainer.step`) and AdamW on a Megatron
``GPTModel`` split over tensor-, pipeline- and data-parallel ranks, whose weights come from (and are
published as) the policy's HF checkpoint.

* Build: every rank converts the HF checkpoint to Megatron's layout (:mod:`~connectors.megatron.convert`)
  and keeps its own piece (:mod:`~connectors.megatron.shard`) of a ``GPTModel`` stage built for
  Megatron's parallel state (:mod:`~connectors.megatron.parallel`).
* Step (collective, the whole batch on every rank): each data-parallel replica trains its share of the
  rows (:mod:`~connectors.megatron.batch`), log-probs come from the vocab-parallel logits, the loss is
  normalised by the whole batch's tokens; gradients are reduced, clipped and applied by megatron-core's
  DDP and distributed optimizer on CUDA (:mod:`~connectors.megatron.megatron_training`) or by torch's
  collectives and AdamW (:mod:`~connectors.megatron.torch_training`, the CPU / gloo path).
* State (collective): ``state_dict`` gathers the pieces to rank 0 in HF names
  (:mod:`~connectors.megatron.gather`); ``load_state`` broadcasts rank 0's and each rank cuts its piece.

With one rank and tp = pp = 1 this is the one-device backend of before, and a step equals the
built-in backend's on the same batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from astraflow.trainer.base import ShardedState
from astraflow.trainer.distributed import current_group
from astraflow.trainer.step import PolicyGradientStep, StepPlan, diagnostics
from connectors.megatron.batch import MicroBatch, micro_batch, replica_rows
from connectors.megatron.config import MegatronBackendConfig
from connectors.megatron.convert import DecoderShape, hf_to_megatron, megatron_to_hf
from connectors.megatron.forward import StageForward, split
from connectors.megatron.gather import LEADER, broadcast_from_leader, gather_to_leader, megatron_meta
from connectors.megatron.logprobs import full_logits
from connectors.megatron.model import build_gpt_model
from connectors.megatron.parallel import init_parallel
from connectors.megatron.shard import Layout, shard

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from astraflow.records import Trajectory

log = logging.getLogger(__name__)

class MegatronBackend(PolicyGradientStep):
    """The shared policy-gradient step (:mod:`astraflow.trainer.step`; GRPO by default) with AdamW on a Megatron-core ``GPTModel`` (fp32 master weights), on one rank or split
    ``tensor_parallel`` x ``pipeline_parallel`` x data parallel over a rank group."""

    runs_as_rank_group: ClassVar[bool] = True

    def __init__(self, model: PreTrainedModel, config: MegatronBackendConfig | dict[str, Any] | None = None) -> None:
        if not isinstance(config, MegatronBackendConfig):
            config = MegatronBackendConfig.model_validate(config or {})
        self.config = config
        self.layout = Layout(tp=config.tensor_parallel, pp=config.pipeline_parallel)
        self.shape = DecoderShape.from_hf_config(model.config)
        self.layout.check(self.shape)
        self.vocab: int = model.config.vocab_size
        group = current_group()
        self.device = torch.device(group.device(config.device))
        use_megatron = config.distributed_optimizer
        if self.shape.tied and self.layout.pp > 1 and not use_megatron:
            # The first and last stages each hold the embedding; Megatron's DDP sums their gradients over
            # its embedding group (and its model build copies one to the other on the GPU).
            raise ValueError("megatron connector: a model with tied embeddings needs Megatron's DDP for "
                             "pipeline_parallel > 1 (distributed_optimizer: true, on CUDA)")
        self.ranks = init_parallel(self.device, self.layout)
        self.world = dist.get_world_size()
        hf_state = {k: v.detach().float() for k, v in model.state_dict().items()}
        self.hf_keys = list(hf_state)
        """The names the HF model publishes (tied models list ``lm_head.weight`` or not, as HF does)."""
        self.hf_meta = {k: torch.empty(v.shape, device="meta") for k, v in hf_state.items()}
        self.full_meta = megatron_meta(self.hf_meta, self.shape, self.layout.padded_vocab(self.vocab))
        self.model = build_gpt_model(model.config, self.device, self.layout)
        if self.world > 1:  # every replica starts from rank 0's weights, whatever each rank loaded
            hf_state = broadcast_from_leader(hf_state if dist.get_rank() == LEADER else None, self.hf_meta,
                                             self._comm_device)
        self._load_hf(hf_state)
        self.reference: torch.nn.Module | None = None
        """The frozen reference policy (a KL term only): this rank's piece, set by set_reference."""
        if config.objective.kl is not None:
            self.reference = build_gpt_model(model.config, self.device, self.layout).eval().requires_grad_(False)
            self._load_hf(hf_state, self.reference)  # the initial weights until set_reference (as the torch backend)
            self._reference_stage = StageForward(self.ranks, config.temperature, self.vocab)
        forward = StageForward(self.ranks, config.temperature, self.vocab, entropy_grad=config.objective.entropy_coef > 0)
        if use_megatron:
            from connectors.megatron.megatron_training import MegatronTraining

            self.training: Any = MegatronTraining(self.model, config, forward)
        else:
            from connectors.megatron.torch_training import TorchTraining

            self.training = TorchTraining(self.model, config, forward)
        self.steps = 0
        self._entries: Any = None
        """The DCP view of this stage (:class:`~connectors.megatron.dcp_state.ShardedEntries`), made at the
        first checkpoint: its device mesh is created once, collectively."""
        log.info("megatron backend: Megatron-core GPTModel (%s, %d layers, %d/%d heads, %.1f M parameters on this "
                 "rank) on %s, tp=%d pp=%d dp=%d, %s", self.shape.arch, self.shape.layers, self.shape.heads,
                 self.shape.groups, sum(p.numel() for p in self.model.parameters()) / 1e6, self.device,
                 self.layout.tp, self.layout.pp, self.ranks.dp,
                 "Megatron DDP + distributed optimizer" if use_megatron else "torch AdamW per rank")

    @property
    def _comm_device(self) -> torch.device:
        """Where collectives' tensors live: this rank's GPU under NCCL, the CPU under gloo."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- weights in ---------------------------------------------------------------------------------
    def _load_hf(self, hf_state: dict[str, torch.Tensor], target: torch.nn.Module | None = None) -> None:
        """Copy this rank's piece of HF-named weights into the ``GPTModel`` (or ``target``, the
        reference); every parameter must be set."""
        whole = hf_to_megatron(hf_state, self.shape)
        mine = shard(whole, self.shape, self.layout, self.vocab, tp_rank=self.ranks.tp_rank, stage=self.ranks.pp_rank)
        with torch.no_grad():
            missing, unexpected = (self.model if target is None else target).load_state_dict(mine, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]  # Transformer Engine metadata
        if missing or unexpected:
            raise ValueError(f"megatron connector: HF -> Megatron conversion left missing={missing} "
                             f"unexpected={unexpected}")

    # -- forward ------------------------------------------------------------------------------------
    def logits(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The whole ``[B, T, V]`` next-token logits (one pipeline stage only; every tensor-parallel rank)."""
        if self.layout.pp > 1:
            raise ValueError("megatron connector: logits() needs the whole model on one stage (pipeline_parallel=1)")
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return full_logits(self.model(ids, positions, attention_mask=None), self.vocab)

    def _forward_only(self, micro: MicroBatch) -> dict[str, Any] | None:
        self.model.eval()
        with torch.no_grad():
            return self.training.forward_backward(micro, lambda out: (out.sum() * 0.0, {"logp": split(out)[0]}),
                                                  forward_only=True)

    # -- the step (the skeleton: astraflow.trainer.step) --------------------------------------------
    def _prepare(self, trajectories: Sequence[Trajectory], plan: StepPlan, c: int) -> MicroBatch:
        """This replica's share of minibatch ``c``'s trained rows."""
        rows, filler = replica_rows(plan.trained[c], self.ranks.dp_rank, self.ranks.dp)
        return micro_batch([trajectories[i] for i in rows], [plan.advantages[i] for i in rows], plan.batch_tokens(c),
                           self.device, filler=filler, row_scale=plan.row_scales(c, rows))

    def _proximal(self, prepared: list[MicroBatch]) -> list[dict[str, Any] | None]:
        return [self._forward_only(m) for m in prepared]

    def _update(self, micro: MicroBatch, before: dict[str, Any] | None, *,
                step_optimizer: bool = True) -> dict[str, float]:
        obj = self.config.objective
        ref = self._reference_forward(micro) if obj.kl is not None and obj.kl.mode == "loss" else None
        self.model.train()
        self.training.zero_grad()
        kept = self.training.forward_backward(micro, self._loss_fn(micro, before, ref), forward_only=False)
        grad_norm = self.training.step() if step_optimizer else 0.0
        self.model.eval()
        m = self._reduce(kept, micro)
        m["grad_norm"] = grad_norm
        return m

    def _optimizer_has_state(self) -> bool:
        return bool(getattr(self.training.optimizer, "state", None))

    def _loss_fn(self, micro: MicroBatch, before: dict[str, Any] | None, ref: torch.Tensor | None):
        dp = self.ranks.dp

        def loss_fn(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logp, entropy = split(out)
            prox = logp.detach() if before is None else before["logp"]
            loss, m = self.objective_loss(logp, prox, micro.behav, micro.adv, micro.mask,
                                          batch_tokens=micro.batch_tokens, row_scale=micro.row_scale,
                                          ref_logp=ref, entropy=entropy)
            # Megatron's DDP (and TorchTraining) average gradients over the replicas; each replica's
            # loss is its part of the whole batch's token mean, whose gradients must be summed.
            return loss * dp, {"metrics": m, "tokens": float(micro.mask.sum())}

        return loss_fn

    def _reduce(self, kept: dict[str, Any] | None, micro: MicroBatch) -> dict[str, float]:
        """The loss (summed) and the diagnostics (token-weighted) of every replica, on every rank."""
        means = diagnostics(self.config.objective)
        values = [0.0] * (2 + len(means))
        if kept is not None and self.ranks.tp_rank == 0:  # one copy per replica: tp ranks hold the same
            m, tokens = kept["metrics"], kept["tokens"]
            values = [m["loss"], tokens, *(m[k] * tokens for k in means)]
        total = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        if self.world > 1:
            dist.all_reduce(total)
        loss, tokens, *diag = total.tolist()
        out = {"loss": loss, "tokens": micro.batch_tokens}
        out.update({k: v / max(tokens, 1.0) for k, v in zip(means, diag, strict=True)})
        return out

    # -- the frozen reference (a KL term) -----------------------------------------------------------
    def _reference_forward(self, micro: MicroBatch) -> torch.Tensor:
        """The reference's log-probs of ``micro``'s response tokens (one pipeline stage: the config
        refuses a KL term with pipeline_parallel > 1)."""
        with torch.no_grad():
            return split(self._reference_stage(self.reference, micro))[0]

    def _reference_logprobs(self, trajectories: Sequence[Trajectory]) -> torch.Tensor:
        return self._reference_forward(micro_batch(trajectories, [0.0] * len(trajectories), 1.0, self.device))

    def set_reference(self, state: dict[str, Any]) -> None:
        """Rank 0's HF-named weights into every rank's piece of the reference model (collective)."""
        if self.world > 1:
            state = broadcast_from_leader(state if dist.get_rank() == LEADER else None, self.hf_meta,
                                          self._comm_device)
        self._load_hf({k: torch.as_tensor(v).float() for k, v in state.items()}, self.reference)

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The whole model in HF names on rank 0 (fp32 CPU copies, or ``dtype``), ``{}`` on the others."""
        whole = gather_to_leader(self.model.state_dict(), self.full_meta, self.shape, self.ranks, self.vocab)
        if not whole:
            return {}
        hf = megatron_to_hf(whole, self.shape)
        out = {k: hf[k].detach().to("cpu", copy=True) for k in self.hf_keys}
        return {k: v.to(dtype) for k, v in out.items()} if dtype is not None else out

    def optimizer_state_dict(self) -> dict[str, Any]:
        if self.world > 1:
            raise NotImplementedError("megatron connector: a rank group's optimizer state is sharded; "
                                      "checkpoint it with sharded_state()")
        return self.training.optimizer_state_dict()

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        leader = dist.get_rank() == LEADER
        if self.world > 1:
            flag = torch.tensor([float(leader and optimizer_state is not None)], device=self._comm_device)
            dist.broadcast(flag, src=LEADER)
            if flag.item():
                raise NotImplementedError("megatron connector: a one-rank optimizer state cannot be loaded into a "
                                          "rank group; resume it from a sharded (DCP) checkpoint")
            model_state = broadcast_from_leader(model_state if leader else None, self.hf_meta, self._comm_device)
        self._load_hf({k: torch.as_tensor(v).float() for k, v in model_state.items()})
        self.training.reload_params()
        if optimizer_state is not None:
            self.training.load_optimizer_state_dict(optimizer_state)

    def sharded_state(self) -> ShardedState:
        """Weights and AdamW moments as DTensor shards of the whole Megatron tensors (views of the live
        ones), for DCP (:mod:`~connectors.megatron.dcp_state`). Collective the first time."""
        from connectors.megatron.dcp_state import ShardedEntries, adam_entries
        from connectors.megatron.torch_training import TorchTraining

        if not isinstance(self.training, TorchTraining):
            raise NotImplementedError("megatron connector: checkpointing megatron-core's distributed optimizer "
                                      "state is not implemented; train with distributed_optimizer: false")
        if self._entries is None:
            self._entries = ShardedEntries(self.model, self.ranks, self.shape, self.vocab, self.device)
        model = self._entries.entries({name: p.detach() for name, p in self.model.named_parameters()})
        optimizer, adam_step = adam_entries(self.training.optimizer, self._entries)
        return ShardedState(tensors={"model": model, "optimizer": optimizer},
                            extras={"adam_step": adam_step, "names": "megatron-whole-model"})

    def load_sharded_state(self, state: ShardedState) -> None:
        """DCP has written into the live weights and moments; the step count comes from the extras."""
        from connectors.megatron.dcp_state import set_adam_step

        if state.extras.get("names") != "megatron-whole-model":
            raise ValueError("megatron connector: this checkpoint was not written by the Megatron backend")
        set_adam_step(self.training.optimizer, int(state.extras["adam_step"]))
        self.training.reload_params()
