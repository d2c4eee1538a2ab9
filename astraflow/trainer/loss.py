"""The GRPO / PPO objective with a truncated importance weight for stale tokens.

Three log-probs of each response token meet here:

* ``behav_logp``: what the RaaS node's engine sampled the token with (recorded in the trajectory,
  possibly several weight versions old);
* ``prox_logp``: the trainer's current weights before this update (the proximal policy, no grad);
* ``logp``: the weights being optimised (with grad).

Per token (decoupled PPO, as in AReaL; the weight truncation as in "TIS"):

    ratio   = exp(logp - prox_logp)
    surr    = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)
    w       = min(exp(prox_logp - behav_logp), is_cap)          (detached)
    loss    = - sum(w * surr * mask) / sum(mask)                (token-level mean over the batch)

``A`` is the GRPO group-normalised advantage of the token's trajectory:
``(r - mean_g(r)) / (std_g(r) + eps)`` with the population std over its group ``g``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-6,
                     scale_by_std: bool = True) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (+eps).

    A group whose rewards are all equal gets zero advantages (it carries no learning signal).
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    groups: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_ids, strict=True):
        groups[g].append(float(r))
    stats = {}
    for g, rs in groups.items():
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        stats[g] = (mean, std)
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        mean, std = stats[g]
        out.append((float(r) - mean) / (std + eps) if scale_by_std else float(r) - mean)
    return out


def policy_loss(logp, prox_logp, behav_logp, advantages, mask, *, clip_eps: float = 0.2,
                clip_eps_high: float | None = None, is_cap: float = 2.0,
                batch_tokens: float | None = None) -> tuple[Any, dict[str, float]]:
    """The clipped surrogate loss (a scalar tensor) and diagnostics.

    ``logp``, ``prox_logp``, ``behav_logp``, ``mask``: ``[B, T]`` over response tokens (padding has
    mask 0); ``advantages``: ``[B]`` (one per trajectory) or ``[B, T]``. ``clip_frac`` is the
    fraction of loss tokens whose ratio lies outside ``[1 - clip_eps, 1 + clip_eps_high]``.
    ``batch_tokens``: the loss's denominator when these rows are part of a batch whose other rows
    were left out because their terms are 0 (zero advantage); default ``mask.sum()``. ``tokens`` is
    then the batch's; the other diagnostics are over these rows' tokens.
    """
    import torch

    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    mask = mask.to(logp.dtype)
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - prox_logp)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_eps, 1.0 + hi) * advantages)
    raw_w = torch.exp(prox_logp - behav_logp).detach()
    w = raw_w.clamp(max=is_cap)
    n_tok = mask.sum().clamp(min=1.0)
    denominator = n_tok if batch_tokens is None else max(float(batch_tokens), 1.0)
    loss = -(w * surr * mask).sum() / denominator
    with torch.no_grad():
        # outside the (possibly asymmetric) trust region [1 - clip_eps, 1 + clip_eps_high]
        clipped = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + hi)).to(logp.dtype)
        metrics = {
            "loss": float(loss),
            "tokens": float(mask.sum()) if batch_tokens is None else float(batch_tokens),
            "clip_frac": float((clipped * mask).sum() / n_tok),
            "is_weight_mean": float((w * mask).sum() / n_tok),
            "is_truncated_frac": float(((raw_w > is_cap).to(logp.dtype) * mask).sum() / n_tok),
            # k3 estimator of KL(behaviour || proximal): how off-policy the batch is
            "behav_kl": float((((raw_w - 1.0) - torch.log(raw_w)) * mask).sum() / n_tok),
        }
    return loss, metrics
