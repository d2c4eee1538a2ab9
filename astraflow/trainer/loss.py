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

``A`` is the advantage of the token's trajectory (:mod:`astraflow.trainer.advantages`; GRPO's
group-normalised one by default). The options of :class:`~astraflow.trainer.objective.ObjectiveConfig`
change the per-token term and its aggregation:

* dual clip (c > 1): ``surr = max(surr, c * A)`` where ``A < 0``;
* KL to the reference (``ref_logp``): ``+ kl_coef * k(logp, ref_logp)`` with k1 = logp - ref_logp or
  k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1;
* entropy bonus: ``- entropy_coef * H_t``;
* aggregation: ``row_scale[i]`` multiplies row ``i``'s token sum instead of ``1 / batch_tokens``
  (sequence means; the step computes it over the whole minibatch, :mod:`astraflow.trainer.step`).
"""

from __future__ import annotations

from typing import Any, Literal

from astraflow.trainer.advantages import group_advantages

__all__ = ["group_advantages", "kl_estimate", "policy_loss", "token_entropy"]


def policy_loss(logp, prox_logp, behav_logp, advantages, mask, *, clip_eps: float = 0.2,
                clip_eps_high: float | None = None, is_cap: float = 2.0, batch_tokens: float | None = None,
                row_scale=None, dual_clip: float | None = None, ref_logp=None, kl_coef: float = 0.0,
                kl_estimator: Literal["k1", "k3"] = "k3", entropy=None,
                entropy_coef: float = 0.0) -> tuple[Any, dict[str, float]]:
    """The clipped surrogate loss (a scalar tensor) and diagnostics.

    ``logp``, ``prox_logp``, ``behav_logp``, ``mask``: ``[B, T]`` over response tokens (padding has
    mask 0); ``advantages``: ``[B]`` (one per trajectory) or ``[B, T]``. ``clip_frac`` is the
    fraction of loss tokens whose ratio lies outside ``[1 - clip_eps, 1 + clip_eps_high]``.
    ``batch_tokens``: the loss's denominator when these rows are part of a batch whose other rows
    were left out because their terms are 0 (zero advantage); default ``mask.sum()``. ``tokens`` is
    then the batch's; the other diagnostics are over these rows' tokens. ``row_scale`` (``[B]``):
    the weight of each row's token sum instead of ``1 / batch_tokens`` (a sequence-mean
    aggregation). ``ref_logp`` (``[B, T]``): the reference policy's log-probs, for the KL term (and
    the ``kl_ref`` diagnostic); ``entropy`` (``[B, T]``): the policy's entropy at each token, with
    gradient when ``entropy_coef`` > 0 (and the ``entropy`` diagnostic).
    """
    import torch

    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    mask = mask.to(logp.dtype)
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - prox_logp)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_eps, 1.0 + hi) * advantages)
    if dual_clip is not None:
        bounded = torch.maximum(surr, dual_clip * advantages)
        dual_clipped = (advantages < 0) & (bounded > surr)
        surr = torch.where(advantages < 0, bounded, surr)
    raw_w = torch.exp(prox_logp - behav_logp).detach()
    w = raw_w.clamp(max=is_cap)
    term = -(w * surr)
    kl = None
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, kl_estimator)
        if kl_coef:
            term = term + kl_coef * kl
    if entropy is not None and entropy_coef:
        term = term - entropy_coef * entropy
    n_tok = mask.sum().clamp(min=1.0)
    if row_scale is None:
        denominator = n_tok if batch_tokens is None else max(float(batch_tokens), 1.0)
        loss = (term * mask).sum() / denominator
    else:
        loss = (term * mask * row_scale[:, None]).sum()
    with torch.no_grad():
        # outside the (possibly asymmetric) trust region [1 - clip_eps, 1 + clip_eps_high]
        clipped = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + hi)).to(logp.dtype)

        def token_mean(x) -> float:
            return float((x * mask).sum() / n_tok)

        metrics = {
            "loss": float(loss),
            "tokens": float(mask.sum()) if batch_tokens is None else float(batch_tokens),
            "clip_frac": token_mean(clipped),
            "is_weight_mean": token_mean(w),
            "is_truncated_frac": token_mean((raw_w > is_cap).to(logp.dtype)),
            # k3 estimator of KL(behaviour || proximal): how off-policy the batch is
            "behav_kl": token_mean((raw_w - 1.0) - torch.log(raw_w)),
        }
        if dual_clip is not None:
            metrics["dual_clip_frac"] = token_mean(dual_clipped.to(logp.dtype))
        if kl is not None:
            metrics["kl_ref"] = token_mean(kl)
        if entropy is not None:
            metrics["entropy"] = token_mean(entropy)
    return loss, metrics


def kl_estimate(logp, ref_logp, estimator: Literal["k1", "k3"]):
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi (Schulman 2020):
    k1 = log pi - log pi_ref; k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1."""
    import torch

    if estimator == "k1":
        return logp - ref_logp
    log_r = ref_logp - logp
    return torch.exp(log_r) - log_r - 1.0


def token_entropy(log_probs):
    """Entropy of each position's distribution from its log-probabilities ``[..., V]`` -> ``[...]``."""
    import torch

    return -(torch.exp(log_probs) * log_probs).sum(-1)
