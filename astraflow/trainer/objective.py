"""A trainer backend's ``objective`` section: which policy-gradient objective the step optimises.

The defaults are the objective AstraFlow always had (GRPO's group-normalised advantage, token-mean
aggregation, no KL, no entropy bonus, no dual clip, no overlong penalty). Each option names the paper
it comes from; the implementation is :mod:`astraflow.trainer.advantages` (rewards -> advantages) and
:mod:`astraflow.trainer.loss` (the per-token loss), shared by every gradient backend (torch, Megatron)
through :mod:`astraflow.trainer.step`. Only options live here (no torch)::

    backend:
      objective:
        advantage: dr_grpo              # grpo | dr_grpo | rloo | reinforce_pp
        aggregation: seq_mean_token_sum # token_mean | seq_mean | seq_mean_token_sum
        norm_tokens: 3                  # seq_mean_token_sum's constant normaliser
        kl: {coef: 0.05, estimator: k3, mode: loss}
        entropy_coef: 0.001
        dual_clip: 3.0
        overlong: {max_tokens: 3, buffer: 1}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KLConfig(_Options):
    """KL divergence to a frozen reference policy: version 0 of the policy as published (the weights
    after the SFT warm start, before any RL step), kept on the trainer's device (sharded like the
    policy under FSDP2). Schulman, "Approximating KL divergence" (2020) for the estimators; as a loss
    term as in GRPO (Shao et al. 2024, DeepSeekMath), folded into the reward as in InstructGPT
    (Ouyang et al. 2022) and REINFORCE++ (Hu 2025)."""

    coef: float = Field(gt=0)
    """Weight of the KL penalty (beta)."""
    estimator: Literal["k1", "k3"] = "k3"
    """Per-token estimator of KL(pi || pi_ref) from the sampled token: k1 = log pi - log pi_ref
    (unbiased, high variance, may be negative); k3 = r - 1 - log r with r = pi_ref / pi (unbiased,
    non-negative, low variance; GRPO's choice)."""
    mode: Literal["loss", "reward"] = "loss"
    """``loss``: ``coef * KL`` of the trained policy is added to each token's loss (aggregated like the
    policy term); ``reward``: ``coef * sum_t KL_t`` of the behaviour policy (the engine's log-probs of
    the sampled tokens) is subtracted from each trajectory's reward before the advantages."""


class OverlongConfig(_Options):
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", section 3.4): a response longer than
    ``max_tokens - buffer`` loses reward linearly over the last ``buffer`` tokens, reaching
    ``-penalty`` at ``max_tokens`` and staying there beyond. Length = the trajectory's trained
    (loss-masked) tokens, i.e. what the policy generated."""

    max_tokens: int = Field(ge=1)
    """L_max: the length at which the full penalty applies (usually the sampling ``max_new_tokens``)."""
    buffer: int = Field(ge=1)
    """L_cache: how many tokens before ``max_tokens`` the penalty starts."""
    penalty: float = Field(default=1.0, gt=0)
    """The penalty at and beyond ``max_tokens`` (DAPO: 1, the scale of a correct answer's reward)."""

    @model_validator(mode="after")
    def _buffer_inside(self) -> OverlongConfig:
        if self.buffer > self.max_tokens:
            raise ValueError(f"overlong.buffer ({self.buffer}) must not exceed overlong.max_tokens ({self.max_tokens})")
        return self


class ObjectiveConfig(_Options):
    """The policy-gradient objective of a gradient backend (``backend.objective``)."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator, from each trajectory's (shaped) reward. ``grpo``: reward minus its group's
    mean, divided by the group's std + ``adv_eps`` (Shao et al. 2024, DeepSeekMath). ``dr_grpo``: minus
    the group mean, no std division (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO;
    pair it with ``aggregation: seq_mean_token_sum`` for the paper's length-unbiased loss). ``rloo``:
    minus the mean of the OTHER samples of its group (Ahmadian et al. 2024, "Back to Basics", after
    Kool et al. 2019). ``reinforce_pp``: the reward normalised over the whole batch's loss tokens
    (mean and std), no group baseline (Hu 2025, "REINFORCE++")."""
    aggregation: Literal["token_mean", "seq_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses become the minibatch's loss. ``token_mean``: their sum over the
    minibatch's loss tokens (DAPO, Yu et al. 2025); ``seq_mean``: each trajectory's token mean, then
    the mean over trajectories (GRPO as published, Shao et al. 2024); ``seq_mean_token_sum``: each
    trajectory's token SUM divided by the constant ``norm_tokens``, then the mean over trajectories
    (Dr. GRPO's length-unbiased normaliser, Liu et al. 2025)."""
    norm_tokens: int | None = Field(default=None, ge=1)
    """The constant token count ``seq_mean_token_sum`` divides by (Dr. GRPO: the generation budget,
    e.g. the sampling ``max_new_tokens``); only with that aggregation."""
    kl: KLConfig | None = None
    """KL to the frozen reference policy (None: none, and no reference is kept)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: ``-entropy_coef * H(pi(.|context))`` per token (Williams & Peng 1991; Mnih et
    al. 2016, A3C). The entropy itself is reported in the step metrics either way."""
    dual_clip: float | None = Field(default=None, gt=1)
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for a
    negative advantage the surrogate is bounded below by ``dual_clip * A`` (c > 1), so a huge ratio on
    a bad token cannot blow up the update. Like the PPO clip it acts only where the ratio to the
    proximal policy departs from 1, i.e. with ``minibatches`` > 1. None: off."""
    overlong: OverlongConfig | None = None
    """DAPO's soft overlong punishment added to the reward (None: off)."""

    @model_validator(mode="after")
    def _normaliser_with_its_aggregation(self) -> ObjectiveConfig:
        if (self.aggregation == "seq_mean_token_sum") != (self.norm_tokens is not None):
            raise ValueError("norm_tokens is required by aggregation: seq_mean_token_sum, and only by it")
        return self

    @property
    def terms_vanish_with_advantage(self) -> bool:
        """Whether a trajectory with advantage 0 contributes nothing to the loss (no KL loss term, no
        entropy bonus): only then may its row be left out of the forward."""
        return self.entropy_coef == 0.0 and (self.kl is None or self.kl.mode != "loss")
