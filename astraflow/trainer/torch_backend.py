"""The built-in trainer backend (``type: torch``): the shared policy-gradient step
(:mod:`astraflow.trainer.step`, the recipe's ``objective``; GRPO by default) with AdamW on a
``transformers`` causal LM, fp32 master weights. Options: :class:`~astraflow.trainer.backend.TorchBackendConfig`.
With a KL objective a frozen copy of the model is the reference policy, sharded like the policy.

On a rank group (``trainer.ranks`` > 1, :mod:`astraflow.trainer.distributed`) the model is sharded with
FSDP2 (``fully_shard`` on each decoder layer, then the root) and AdamW steps on the shards. Every rank
gets the whole batch; each forwards its share of the trained rows (round robin), with the loss divided
by the WHOLE batch's loss tokens and multiplied by the world size, so that FSDP's averaged
reduce-scatter yields the single-rank gradient. A rank left without a row forwards one row with zero
advantage and zero mask (terms exactly 0) so that every rank takes part in every collective.
Diagnostics are reduced over the group (the loss summed, the rest token-weighted).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from astraflow.devices import describe as describe_device
from astraflow.trainer.base import ShardedState, WeightRows
from astraflow.trainer.config import TorchBackendConfig
from astraflow.trainer.distributed import RankGroup, current_group
from astraflow.trainer.step import PolicyGradientStep, StepPlan, diagnostics

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from astraflow.records import Trajectory

log = logging.getLogger(__name__)


@dataclass
class _Rows:
    """One minibatch as this rank forwards it."""

    trajectories: list[Trajectory]
    adv: torch.Tensor
    filler: bool
    """A rank without rows of its own forwards one with a zero mask (it joins the collectives)."""
    batch_tokens: float
    """The whole minibatch's loss tokens (over every rank and skipped row)."""
    row_scale: torch.Tensor | None
    """Each row's weight under a sequence-mean aggregation (None: token mean)."""


class TorchBackend(PolicyGradientStep):
    """The shared policy-gradient step (:mod:`astraflow.trainer.step`; GRPO by default) on a
    ``transformers`` causal LM with AdamW (fp32 master weights).

    A subclass on another model class (Megatron's ``GPTModel``) reuses the step; on a rank group it
    sets :attr:`dp_rank` / :attr:`dp_size` (its data-parallel place, which decides the rows it trains),
    overrides :meth:`_all_reduce_sum` for its data-parallel group, says ``runs_as_rank_group = True``
    once it keeps the contract, and opts in to FSDP2 + DCP with ``shards_over_ranks = True`` only if
    those fit its model."""

    runs_as_rank_group: ClassVar[bool] = True
    shards_over_ranks: ClassVar[bool] = True
    """On a rank group, shard the model with FSDP2 and checkpoint through DCP (:meth:`sharded_state`).
    A subclass does so, and runs as a rank group at all, only if it says so itself."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for claim in ("runs_as_rank_group", "shards_over_ranks"):
            if claim not in cls.__dict__:
                setattr(cls, claim, False)

    def __init__(self, model: PreTrainedModel, config: TorchBackendConfig | dict[str, Any] | None = None,
                 group: RankGroup | None = None) -> None:
        import torch

        if not isinstance(config, TorchBackendConfig):
            config = TorchBackendConfig.model_validate(config or {})
        self.config = config
        self.group = current_group() if group is None else group
        self.device = torch.device(self.group.device(config.device))
        self.model = model.to(self.device).float()
        self.dp_rank, self.dp_size = (self.group.rank, self.group.world_size) if self.group.distributed else (0, 1)
        """This rank's place among the ranks that split a batch's rows (1 rank: 0 of 1)."""
        self.reference: Any = None
        """The frozen reference policy (a KL term only), sharded like the policy; set by set_reference."""
        if config.objective.kl is not None:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self.group.distributed and self.shards_over_ranks:
            _shard(self.model, self.device)
            if self.reference is not None:
                _shard(self.reference, self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.steps = 0
        self._aliases: dict[str, str] = {}
        """Tied weights left out of the sharded state: alias -> the name stored (set by sharded_state)."""
        where = describe_device(self.device)
        if self.group.distributed and self.shards_over_ranks:
            where += f", FSDP2 rank {self.group.rank} of {self.group.world_size}"
        log.info("training %s on %s", type(self.model).__name__, where)

    # -- batch preparation ------------------------------------------------------------------------
    def _tensors(self, trajs: Sequence[Trajectory]) -> tuple[torch.Tensor, ...]:
        import torch

        from astraflow.trainer.packing import pack

        b = pack(trajs)
        return tuple(torch.from_numpy(a).to(self.device) for a in (b.ids, b.attn, b.gather_pos, b.behav, b.mask))

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, model: Any = None) -> torch.Tensor:
        """Next-token logits ``[B, T, V]`` of the trained model (or of ``model``, the reference)."""
        return (self.model if model is None else model)(input_ids=ids, attention_mask=attn).logits

    def token_logprobs(self, ids: torch.Tensor, attn: torch.Tensor, gather_pos: torch.Tensor) -> torch.Tensor:
        """log pi(response token) under the current weights, ``[B, T_resp]``."""
        return self._scores(ids, attn, gather_pos)[0]

    def _scores(self, ids: torch.Tensor, attn: torch.Tensor, gather_pos: torch.Tensor, *, model: Any = None,
                entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The response tokens' log-probs ``[B, T_resp]`` and, if ``entropy`` is "value" (no gradient)
        or "grad", the entropy of each response position's distribution."""
        import torch

        from astraflow.trainer.loss import token_entropy

        logits = self.logits(ids, attn, model).float() / self.config.temperature
        rows = logits.gather(1, gather_pos[:, :, None].expand(-1, -1, logits.shape[-1]))
        targets = ids.gather(1, (gather_pos + 1).clamp(max=ids.shape[1] - 1))
        log_probs = torch.log_softmax(rows, dim=-1)
        logp = log_probs.gather(-1, targets[:, :, None]).squeeze(-1)
        if entropy is None:
            return logp, None
        if entropy == "grad":
            return logp, token_entropy(log_probs)
        with torch.no_grad():  # a diagnostic: one row at a time, so its temporary is [T_resp, V], not [B, T_resp, V]
            return logp, torch.stack([token_entropy(row) for row in log_probs])

    # -- the step (the skeleton: astraflow.trainer.step) -------------------------------------------
    def _prepare(self, trajectories: Sequence[Trajectory], plan: StepPlan, c: int) -> _Rows:
        import torch

        mine = self._rank_rows(plan.trained[c])
        sub, adv, filler = self._rank_batch(trajectories, mine, plan.advantages)
        scales = plan.row_scales(c, mine or [0])
        row_scale = None if scales is None else torch.tensor(
            [0.0] * len(sub) if filler else scales, dtype=torch.float32, device=self.device)
        return _Rows(trajectories=sub, adv=adv, filler=filler, batch_tokens=plan.batch_tokens(c), row_scale=row_scale)

    def _proximal(self, prepared: list[_Rows]) -> list[torch.Tensor]:
        import torch

        self.model.train()
        with torch.no_grad():
            return [self.token_logprobs(*self._tensors(m.trajectories)[:3]) for m in prepared]

    def _update(self, m: _Rows, proximal: torch.Tensor | None, *, step_optimizer: bool = True) -> dict[str, float]:
        import torch

        cfg, obj = self.config, self.config.objective
        self.model.train()
        ids, attn, gpos, behav, mask = self._tensors(m.trajectories)
        if m.filler:
            mask.zero_()  # a row only so that this rank joins the collectives: no terms, no tokens
        logp, entropy = self._scores(ids, attn, gpos, entropy="grad" if obj.entropy_coef else "value")
        # one update per batch: the proximal policy is the current one
        prox = logp.detach() if proximal is None else proximal
        ref = None
        if obj.kl is not None and obj.kl.mode == "loss":
            with torch.no_grad():
                ref = self._scores(ids, attn, gpos, model=self.reference)[0]
        loss, metrics = self.objective_loss(logp, prox, behav, m.adv, mask, batch_tokens=m.batch_tokens,
                                            row_scale=m.row_scale, ref_logp=ref, entropy=entropy)
        self.optimizer.zero_grad(set_to_none=True)
        # FSDP averages the ranks' gradients; each rank's loss is its share of the batch's sum
        (loss * self.dp_size if self.dp_size > 1 else loss).backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        if step_optimizer:
            self.optimizer.step()
        self.model.eval()
        metrics = self._reduced(metrics, float(mask.sum()))
        metrics["grad_norm"] = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        return metrics

    def _optimizer_has_state(self) -> bool:
        return bool(self.optimizer.state)

    def _reference_logprobs(self, trajectories: Sequence[Trajectory]) -> torch.Tensor:
        import torch

        ids, attn, gpos, _, _ = self._tensors(trajectories)
        with torch.no_grad():
            return self._scores(ids, attn, gpos, model=self.reference)[0]

    def set_reference(self, state: dict[str, Any]) -> None:
        import torch

        if self.group.distributed and self.shards_over_ranks:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.reference, dict(state) if self.group.leader else {}, options=options)
            return
        with torch.no_grad():
            self.reference.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)

    def _rank_rows(self, trained: list[int]) -> list[int]:
        """This rank's share of a minibatch's trained rows (all of them on one rank)."""
        return trained[self.dp_rank:: self.dp_size] if self.dp_size > 1 else trained

    def _rank_batch(self, trajectories: Sequence[Trajectory], mine: list[int],
                    adv: list[float]) -> tuple[list[Trajectory], torch.Tensor, bool]:
        """The trajectories this rank forwards, their advantages, and whether they are a filler: a
        rank without rows forwards the batch's first with advantage 0 (its mask is zeroed too)."""
        import torch

        filler = not mine
        rows = mine or [0]
        a = torch.tensor([0.0 if filler else adv[i] for i in rows], dtype=torch.float32, device=self.device)
        return [trajectories[i] for i in rows], a, filler

    def _reduced(self, m: dict[str, float], tokens: float) -> dict[str, float]:
        """A minibatch's diagnostics over the group: the loss (each rank's share of the batch's sum)
        summed, the per-token means weighted by each rank's loss tokens."""
        if self.dp_size == 1:
            return m
        means = diagnostics(self.config.objective)
        sums = self._all_reduce_sum([m["loss"], tokens, *(m[k] * tokens for k in means)])
        out = dict(m, loss=sums[0])
        out.update({k: v / sums[1] if sums[1] else 0.0 for k, v in zip(means, sums[2:], strict=True)})
        return out

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over the ranks that split the batch (collective)."""
        return self.group.all_reduce_sum(values)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Detached CPU copies of the weights (cast to ``dtype``, e.g. torch.bfloat16, if given). On a
        rank group (collective): the full weights gathered on rank 0, ``{}`` on the others."""
        if self.group.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        return {k: v.to(dtype) for k, v in sd.items()} if dtype is not None else sd

    def published_weights(self, dtype: torch.dtype, *, on_device: bool = False) -> dict[str, Any]:
        if self.group.distributed or not on_device or self.device.type == "cpu":
            return super().published_weights(dtype, on_device=on_device)
        # One cast copy per tensor on the GPU: the publisher encodes there (codec._diff_device).
        return {k: v.detach().to(dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
                for k, v in self.model.state_dict().items()}

    @property
    def publishes_rows(self) -> bool:
        return self.group.distributed and self.shards_over_ranks

    def weight_rows(self, dtype: torch.dtype | None = None, *, on_device: bool = False) -> WeightRows:
        """On a rank group sharded with FSDP2: this rank's rows of every weight (its ``Shard(0)`` of the
        parameter, ``ceil(n / ranks)`` rows a rank), CPU copies cast to ``dtype``; a plain tensor (a buffer,
        the same on every rank) is rank 0's whole."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor, Shard

        from astraflow.delta.parts import chunk_rows

        rank, ranks = self.group.rank, self.group.world_size
        out = WeightRows({}, {}, {})
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        for name, t in sd.items():
            shape = list(t.shape)
            rows = shape[0] if shape else 1
            if isinstance(t, DTensor):
                if tuple(t.placements) != (Shard(0),):
                    raise RuntimeError(f"{name}: placements {t.placements}, not FSDP2's Shard(0): cannot publish rows")
                local, span = t.to_local(), chunk_rows(rows, rank, ranks)
                if local.shape[0] != span[1] - span[0]:
                    raise RuntimeError(f"{name}: rank {rank} holds {local.shape[0]} rows, not rows {span} of {rows}")
            else:
                local, span = t, (0, rows) if rank == 0 else (0, 0)
            out.shapes[name] = shape
            if span[1] > span[0]:  # one copy, cast on the way (the fp32 masters are never copied whole)
                cast = dtype if dtype is not None and local.is_floating_point() else local.dtype
                where = local.device if on_device else "cpu"
                out.tensors[name] = local.detach().to(where, dtype=cast, copy=True).contiguous()
                out.rows[name] = span
        return out

    def optimizer_state_dict(self) -> dict[str, Any]:
        """A deep copy: torch returns live references to the moment tensors, which the next step
        would mutate under a checkpoint being written off the critical path."""
        if self.group.distributed:
            raise NotImplementedError("a rank group checkpoints through sharded_state (DCP)")
        return copy.deepcopy(self.optimizer.state_dict())

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        import torch

        if self.group.distributed:
            self._load_full_state_on_group(model_state, optimizer_state)
            return
        with torch.no_grad():
            self.model.load_state_dict(model_state, strict=True)
        if optimizer_state is not None:
            # torch keeps the given moment tensors when dtype/device match: never share them
            self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))

    def _load_full_state_on_group(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        """Rank 0's full state broadcast into every rank's shards (collective). A single-rank
        optimizer state (keyed by parameter index) is re-keyed by parameter name first."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # copies of the mappings: torch puts the shards it makes into the dict it is given, and the
        # caller's may be the publisher's base version (weights pulled from the store)
        set_model_state_dict(self.model, dict(model_state) if self.group.leader else {}, options=options)
        with_optimizer = self.group.broadcast_bytes(b"1" if optimizer_state is not None else b"") == b"1"
        if with_optimizer:
            named = _by_name(self.model, optimizer_state) if self.group.leader and optimizer_state else {}
            set_optimizer_state_dict(self.model, self.optimizer, named, options=options)

    def sharded_state(self) -> ShardedState | None:
        """Model and AdamW state by parameter name (DTensor shards on a rank group) for DCP; the
        param groups (hyper-parameters) as extras. None for a subclass that did not opt in."""
        if not self.shards_over_ranks:
            return None
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        # a tied weight (lm_head = embed_tokens) is stored once: safetensors refuses shared memory
        self._aliases = _aliases(model)
        model = {k: v for k, v in model.items() if k not in self._aliases}
        return ShardedState(tensors={"model": model, "optimizer": optim["state"]},
                            extras={"param_groups": optim["param_groups"]})

    def load_sharded_state(self, state: ShardedState) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model = dict(state.tensors["model"])
        model.update({alias: model[name] for alias, name in self._aliases.items()})
        set_state_dict(self.model, self.optimizer, model_state_dict=model,
                       optim_state_dict={"state": state.tensors["optimizer"],
                                         "param_groups": state.extras["param_groups"]})


def _shard(model: Any, device: torch.device) -> None:
    """FSDP2 over the whole group: each decoder layer (the classes the model names in
    ``_no_split_modules``) its own unit, then the root (embeddings, final norm, tied head)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _aliases(state: dict[str, Any]) -> dict[str, str]:
    """Names whose tensor shares its memory with an earlier name's (tied weights): alias -> name."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out = {}
    for name, t in state.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        where = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if where in seen and local.numel():
            out[name] = seen[where]
        else:
            seen.setdefault(where, name)
    return out


def _by_name(model: Any, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A single-rank AdamW state dict (parameters by index, in ``model.parameters()`` order) keyed by
    parameter name, as torch.distributed.checkpoint's full optimizer state is."""
    names = [name for name, _ in model.named_parameters()]
    state = {names[i]: dict(v) for i, v in optimizer_state["state"].items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer_state["param_groups"]]
    return {"state": state, "param_groups": groups}
