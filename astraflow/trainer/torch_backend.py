"""The built-in trainer backend (``type: torch``): GRPO/PPO with AdamW on a ``transformers`` causal
LM, fp32 master weights, the objective of ``astraflow.trainer.loss``. Options:
:class:`~astraflow.trainer.backend.TorchBackendConfig`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from astraflow.devices import describe as describe_device
from astraflow.trainer.backend import TorchBackendConfig
from astraflow.trainer.base import TrainerBackend
from astraflow.trainer.loss import group_advantages, policy_loss

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from astraflow.records import Trajectory

log = logging.getLogger(__name__)


class TorchBackend(TrainerBackend):
    """GRPO/PPO on a ``transformers`` causal LM with AdamW (fp32 master weights)."""

    def __init__(self, model: PreTrainedModel, config: TorchBackendConfig | dict[str, Any] | None = None) -> None:
        import torch

        if not isinstance(config, TorchBackendConfig):
            config = TorchBackendConfig.model_validate(config or {})
        self.config = config
        self.device = torch.device(config.device)
        self.model = model.to(self.device).float()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.steps = 0
        log.info("training %s on %s", type(self.model).__name__, describe_device(self.device))

    # -- batch preparation ------------------------------------------------------------------------
    def _tensors(self, trajs: Sequence[Trajectory]) -> tuple[torch.Tensor, ...]:
        import numpy as np
        import torch

        seqs = [list(t.prompt_ids) + list(t.response_ids) for t in trajs]
        width = max(len(s) for s in seqs)
        resp_w = max(max(len(t.response_ids) for t in trajs), 1)
        n = len(trajs)
        # Filled row by row in numpy, then handed to torch once: a small torch op per row and column
        # cost more than the rest of the batch's preparation.
        ids = np.zeros((n, width), dtype=np.int64)
        attn = np.zeros((n, width), dtype=np.int64)
        # gather index: logits at position p predict token p+1
        gather_pos = np.zeros((n, resp_w), dtype=np.int64)
        behav = np.zeros((n, resp_w), dtype=np.float32)
        mask = np.zeros((n, resp_w), dtype=np.float32)
        for i, (t, s) in enumerate(zip(trajs, seqs, strict=True)):
            ids[i, : len(s)] = s
            attn[i, : len(s)] = 1
            r, p = len(t.response_ids), len(t.prompt_ids)
            if len(t.logprobs) != r or len(t.loss_mask) != r:
                raise ValueError(f"trajectory {getattr(t, 'episode_id', i)}: per-token lengths differ")
            if r:
                gather_pos[i, :r] = np.arange(p - 1, p - 1 + r)
                behav[i, :r] = t.logprobs
                mask[i, :r] = t.loss_mask
        return tuple(torch.from_numpy(a).to(self.device) for a in (ids, attn, gather_pos, behav, mask))

    def logits(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, V]`` of the trained model (a backend on another model class,
        e.g. Megatron's ``GPTModel``, overrides only this)."""
        return self.model(input_ids=ids, attention_mask=attn).logits

    def token_logprobs(self, ids: torch.Tensor, attn: torch.Tensor, gather_pos: torch.Tensor) -> torch.Tensor:
        """log pi(response token) under the current weights, ``[B, T_resp]``."""
        import torch

        logits = self.logits(ids, attn).float() / self.config.temperature
        rows = logits.gather(1, gather_pos[:, :, None].expand(-1, -1, logits.shape[-1]))
        targets = ids.gather(1, (gather_pos + 1).clamp(max=ids.shape[1] - 1))
        return torch.log_softmax(rows, dim=-1).gather(-1, targets[:, :, None]).squeeze(-1)

    # -- the step ---------------------------------------------------------------------------------
    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        import torch

        if not trajectories:
            raise ValueError("empty batch")
        t0 = time.perf_counter()
        cfg = self.config
        rewards = [float(t.reward) for t in trajectories]
        adv = group_advantages(rewards, [t.group_id for t in trajectories], eps=cfg.adv_eps)
        self.model.train()
        n = len(trajectories)
        order = list(range(n))
        chunks = [order[i:: cfg.minibatches] for i in range(cfg.minibatches) if order[i:: cfg.minibatches]]
        agg: dict[str, float] = {}
        # The rows each minibatch forwards: without the zero-advantage ones, whose terms are 0.
        rows = {tuple(c): self._trained_rows(c, adv) for c in chunks}
        for chunk in chunks:
            trained = rows[tuple(chunk)]
            sub = [trajectories[i] for i in trained]
            ids, attn, gpos, behav, mask = self._tensors(sub)
            a = torch.tensor([adv[i] for i in trained], dtype=torch.float32, device=self.device)
            logp = self.token_logprobs(ids, attn, gpos)
            if cfg.minibatches == 1:
                prox = logp.detach()  # one update per batch: the proximal policy is the current one
            else:
                if not agg:  # proximal log-probs for every minibatch, before the first update
                    with torch.no_grad():
                        prox_all = {}
                        for c, r in rows.items():
                            t_ = self._tensors([trajectories[i] for i in r])
                            prox_all[c] = self.token_logprobs(t_[0], t_[1], t_[2])
                prox = prox_all[tuple(chunk)]
            chunk_tokens = sum(sum(trajectories[i].loss_mask) for i in chunk)
            loss, m = policy_loss(logp, prox, behav, a, mask, clip_eps=cfg.clip_eps,
                                  clip_eps_high=cfg.clip_eps_high, is_cap=cfg.is_cap, batch_tokens=chunk_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            m["grad_norm"] = float(gn)
            for k, v in m.items():
                agg[k] = agg.get(k, 0.0) + v / len(chunks)
        self.model.eval()
        self.steps += 1
        agg.update(
            reward_mean=sum(rewards) / n,
            trajectories=float(n),
            trained_trajectories=float(sum(len(r) for r in rows.values())),
            zero_adv_frac=sum(1 for x in adv if x == 0.0) / n,
            step_seconds=time.perf_counter() - t0,
        )
        return agg

    def _trained_rows(self, chunk: list[int], adv: list[float]) -> list[int]:
        """The rows of ``chunk`` to forward: all, or (``skip_zero_advantage``) those with a nonzero
        advantage, and at least one, so that every parameter still gets a gradient (zero) and the
        optimizer steps exactly as it would on the whole chunk."""
        if not self.config.skip_zero_advantage:
            return chunk
        return [i for i in chunk if adv[i] != 0.0] or chunk[:1]

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Detached CPU copies of the weights (cast to ``dtype``, e.g. torch.bfloat16, if given)."""
        sd = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        return {k: v.to(dtype) for k, v in sd.items()} if dtype is not None else sd

    def optimizer_state_dict(self) -> dict[str, Any]:
        """A deep copy: torch returns live references to the moment tensors, which the next step
        would mutate under a checkpoint being written off the critical path."""
        import copy

        return copy.deepcopy(self.optimizer.state_dict())

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        import torch

        with torch.no_grad():
            self.model.load_state_dict(model_state, strict=True)
        if optimizer_state is not None:
            import copy

            # torch keeps the given moment tensors when dtype/device match: never share them
            self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
