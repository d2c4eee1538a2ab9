"""The policy-gradient step every gradient backend shares (the built-in torch one, the Megatron
connector): rewards shaped and turned into advantages (:mod:`astraflow.trainer.advantages`), the batch
cut into minibatches, the rows each minibatch trains, the loss's aggregation weights, the proximal
log-probs taken before the first update, one update per minibatch, the metrics averaged. A backend
fills in how it runs a model on rows (:meth:`PolicyGradientStep._prepare`,
:meth:`~PolicyGradientStep._proximal`, :meth:`~PolicyGradientStep._update`,
:meth:`~PolicyGradientStep._reference_logprobs`) and calls :meth:`PolicyGradientStep.objective_loss`
for the loss, so both optimise the same objective (:class:`~astraflow.trainer.objective.ObjectiveConfig`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.trainer.advantages import advantages, overlong_penalty
from astraflow.trainer.base import TrainerBackend
from astraflow.trainer.loss import kl_estimate, policy_loss
from astraflow.trainer.objective import ObjectiveConfig

if TYPE_CHECKING:
    import torch

    from astraflow.records import Trajectory
    from astraflow.trainer.config import TorchBackendConfig

BASE_DIAGNOSTICS = ("clip_frac", "is_weight_mean", "is_truncated_frac", "behav_kl", "entropy")
"""policy_loss's per-token means that every step reports (combined over ranks weighted by tokens)."""


def diagnostics(objective: ObjectiveConfig) -> tuple[str, ...]:
    """The per-token means a step under ``objective`` reports: the same names on every rank."""
    extra = ("kl_ref",) if objective.kl is not None and objective.kl.mode == "loss" else ()
    return BASE_DIAGNOSTICS + extra + (("dual_clip_frac",) if objective.dual_clip is not None else ())


@dataclass
class StepPlan:
    """What a step decides before any forward: advantages, minibatches and the rows each trains."""

    rewards: list[float]
    """Each trajectory's reward as recorded."""
    tokens: list[float]
    """Each trajectory's loss tokens."""
    advantages: list[float]
    chunks: list[list[int]]
    """The minibatches' rows (round robin over the batch)."""
    trained: list[list[int]]
    """Per minibatch, the rows forwarded (without zero-advantage rows when their terms vanish)."""
    objective: ObjectiveConfig
    metrics: dict[str, float] = field(default_factory=dict)
    """Batch-level figures of the shaping (KL in the reward, overlong penalty)."""

    def batch_tokens(self, c: int) -> float:
        """Minibatch ``c``'s loss tokens: the token-mean loss's denominator."""
        return float(sum(self.tokens[i] for i in self.chunks[c]))

    def row_scales(self, c: int, rows: Sequence[int]) -> list[float] | None:
        """The weight of each of ``rows``' token sums in minibatch ``c``'s loss under a sequence-mean
        aggregation (None: token mean, ``1 / batch_tokens``)."""
        n = len(self.chunks[c])
        if self.objective.aggregation == "token_mean":
            return None
        if self.objective.aggregation == "seq_mean":
            return [1.0 / (n * self.tokens[i]) if self.tokens[i] else 0.0 for i in rows]
        assert self.objective.norm_tokens is not None  # the config requires it with this aggregation
        return [1.0 / (n * self.objective.norm_tokens) for _ in rows]


class PolicyGradientStep(TrainerBackend):
    """The step skeleton; a subclass has ``config`` (a :class:`TorchBackendConfig`), ``steps`` and the
    hooks below."""

    config: TorchBackendConfig
    steps: int

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        if not trajectories:
            raise ValueError("empty batch")
        t0 = time.perf_counter()
        plan = self.plan(trajectories)
        prepared = [self._prepare(trajectories, plan, c) for c in range(len(plan.chunks))]
        # The proximal policy of every minibatch is the weights before the first update.
        prox = self._proximal(prepared) if self.config.minibatches > 1 else [None] * len(prepared)
        agg: dict[str, float] = {}
        skipped = 0
        for c, (m, before) in enumerate(zip(prepared, prox, strict=True)):
            # the same decision on every rank: the plan is computed alike everywhere
            step_optimizer = self._has_signal(plan, c)
            skipped += not step_optimizer
            for k, v in self._update(m, before, step_optimizer=step_optimizer).items():
                agg[k] = agg.get(k, 0.0) + v / len(prepared)
        self.steps += 1
        n = len(trajectories)
        agg.update(plan.metrics)
        agg["updates_skipped"] = float(skipped)
        agg.update(reward_mean=sum(plan.rewards) / n, trajectories=float(n),
                   trained_trajectories=float(sum(len(r) for r in plan.trained)),
                   zero_adv_frac=sum(1 for x in plan.advantages if x == 0.0) / n,
                   step_seconds=time.perf_counter() - t0)
        return agg

    def plan(self, trajectories: Sequence[Trajectory]) -> StepPlan:
        """Shape the rewards, estimate the advantages, cut the minibatches (collective when the KL is
        folded into the reward: the reference forwards the batch)."""
        cfg, obj = self.config, self.config.objective
        rewards = [float(t.reward) for t in trajectories]
        tokens = [float(sum(t.loss_mask)) for t in trajectories]
        n = len(trajectories)
        chunks = [list(range(n))[i:: cfg.minibatches] for i in range(min(cfg.minibatches, n))]
        shaped, metrics = list(rewards), {}
        if obj.overlong is not None:
            penalties = [overlong_penalty(k, obj.overlong) for k in tokens]
            shaped = [r + p for r, p in zip(shaped, penalties, strict=True)]
            metrics["overlong_penalty_mean"] = sum(penalties) / n
        if obj.kl is not None and obj.kl.mode == "reward":
            kl = self._behaviour_kl(trajectories, chunks)
            shaped = [r - obj.kl.coef * k for r, k in zip(shaped, kl, strict=True)]
            metrics["kl_ref"] = sum(kl) / max(sum(tokens), 1.0)  # per token, as in the loss mode
        if shaped != rewards:
            metrics["shaped_reward_mean"] = sum(shaped) / n
        adv = advantages(obj, shaped, [t.group_id for t in trajectories], tokens, cfg.adv_eps)
        return StepPlan(rewards=rewards, tokens=tokens, advantages=adv, chunks=chunks,
                        trained=[self._trained_rows(c, adv) for c in chunks], objective=obj, metrics=metrics)

    def _has_signal(self, plan: StepPlan, c: int) -> bool:
        """Whether minibatch ``c`` steps the optimizer: not when every advantage in it is 0 and the
        objective has no other term (its gradient is 0; Adam would move the weights all the same),
        unless ``step_without_signal``."""
        if self.config.step_without_signal or not self.config.objective.terms_vanish_with_advantage:
            return True
        # An optimizer that never stepped has no state for a checkpoint to hold; with no momentum yet, a
        # zero gradient moves nothing, so its first step is taken whatever the signal.
        return not self._optimizer_has_state() or any(plan.advantages[i] != 0.0 for i in plan.chunks[c])

    def _trained_rows(self, chunk: list[int], adv: list[float]) -> list[int]:
        """The rows of ``chunk`` to forward: all, or (``skip_zero_advantage``, with an objective whose
        terms vanish with the advantage) those with a nonzero advantage, and at least one, so that every
        parameter still gets a gradient (zero) and the optimizer steps exactly as on the whole chunk."""
        if not (self.config.skip_zero_advantage and self.config.objective.terms_vanish_with_advantage):
            return chunk
        return [i for i in chunk if adv[i] != 0.0] or chunk[:1]

    def _behaviour_kl(self, trajectories: Sequence[Trajectory], chunks: list[list[int]]) -> list[float]:
        """Each trajectory's sum over its loss tokens of the KL estimate between the behaviour policy
        (the engine's log-probs) and the reference."""
        import torch

        from astraflow.trainer.packing import pack

        out = [0.0] * len(trajectories)
        for chunk in chunks:
            rows = [trajectories[i] for i in chunk]
            b = pack(rows)
            ref = self._reference_logprobs(rows).detach().to("cpu", torch.float32)
            behav, mask = torch.from_numpy(b.behav), torch.from_numpy(b.mask)
            kl = kl_estimate(behav, ref, self.config.objective.kl.estimator) * mask  # type: ignore[union-attr]
            for i, s in zip(chunk, kl.sum(-1).tolist(), strict=True):
                out[i] = s
        return out

    def objective_loss(self, logp: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, adv: torch.Tensor,
                       mask: torch.Tensor, *, batch_tokens: float, row_scale: torch.Tensor | None,
                       ref_logp: torch.Tensor | None, entropy: torch.Tensor | None) -> tuple[Any, dict[str, float]]:
        """The configured objective on one forward's rows (:func:`astraflow.trainer.loss.policy_loss`)."""
        cfg, obj = self.config, self.config.objective
        kl_loss = obj.kl if obj.kl is not None and obj.kl.mode == "loss" else None
        return policy_loss(logp, prox, behav, adv, mask, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                           is_cap=cfg.is_cap, batch_tokens=batch_tokens, row_scale=row_scale,
                           dual_clip=obj.dual_clip, ref_logp=ref_logp if kl_loss else None,
                           kl_coef=kl_loss.coef if kl_loss else 0.0,
                           kl_estimator=kl_loss.estimator if kl_loss else "k3", entropy=entropy,
                           entropy_coef=obj.entropy_coef)

    @property
    def wants_reference(self) -> bool:
        """Whether the objective has a KL term, so that the trainer must hand the backend its frozen
        reference (:meth:`set_reference`) after the bootstrap."""
        return self.config.objective.kl is not None

    # -- what a backend fills in --------------------------------------------------------------------
    @abstractmethod
    def _prepare(self, trajectories: Sequence[Trajectory], plan: StepPlan, c: int) -> Any:
        """Minibatch ``c``'s inputs for this rank (its share of ``plan.trained[c]``)."""

    @abstractmethod
    def _proximal(self, prepared: list[Any]) -> list[Any]:
        """Every minibatch's log-probs under the weights before the first update (no gradient)."""

    @abstractmethod
    def _update(self, prepared: Any, proximal: Any, *, step_optimizer: bool = True) -> dict[str, float]:
        """One optimizer step on one minibatch (its forward and backward only, without
        ``step_optimizer``: the diagnostics still come); its metrics reduced over the ranks
        (``grad_norm`` too)."""

    @abstractmethod
    def _optimizer_has_state(self) -> bool:
        """Whether the optimizer has stepped (or loaded a state) and so holds its moments."""

    @abstractmethod
    def _reference_logprobs(self, trajectories: Sequence[Trajectory]) -> torch.Tensor:
        """The reference policy's log-probs of ``trajectories``' response tokens ``[B, R]`` as
        :func:`~astraflow.trainer.packing.pack` lays them out, on every rank (collective)."""

    @abstractmethod
    def set_reference(self, state: dict[str, Any]) -> None:
        """Load the frozen reference policy from HF-named weights (rank 0's; collective, like
        :meth:`load_state`)."""
