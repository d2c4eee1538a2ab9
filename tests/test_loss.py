"""The trainer's GRPO/PPO loss against an independent plain-Python reference, to 1e-5."""

import math
import random

import pytest
import torch

from astraflow.trainer.loss import group_advantages, policy_loss


def reference_loss(logp, prox, behav, rewards, groups, mask, clip_eps, clip_hi, is_cap, eps):
    """Written from the objective's definition with loops and floats only."""
    adv = []
    for i, g in enumerate(groups):
        rs = [rewards[j] for j in range(len(groups)) if groups[j] == g]
        mu = sum(rs) / len(rs)
        sd = (sum((r - mu) ** 2 for r in rs) / len(rs)) ** 0.5
        adv.append((rewards[i] - mu) / (sd + eps))
    total, count = 0.0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - prox[i][t])
            clipped = min(max(ratio, 1 - clip_eps), 1 + clip_hi)
            surr = min(ratio * adv[i], clipped * adv[i])
            w = min(math.exp(prox[i][t] - behav[i][t]), is_cap)
            total += -w * surr
            count += 1
    return total / count, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_reference(seed):
    rng = random.Random(seed)
    B, T = 12, 5
    groups = [f"g{i // 4}" for i in range(B)]
    rewards = [float(rng.random() < 0.5) for _ in range(B)]
    rewards[0], rewards[1] = 1.0, 0.0  # group g0 has variance
    rewards[8:12] = [1.0] * 4          # a zero-variance group (all advantages 0)
    mask = [[1 if t < rng.randint(1, T) else 0 for t in range(T)] for _ in range(B)]
    behav = [[rng.uniform(-3, -0.05) for _ in range(T)] for _ in range(B)]
    # proximal and new log-probs that move far enough to hit both the clip and the IS cap
    prox = [[b + rng.uniform(-0.3, 1.2) for b in row] for row in behav]
    logp = [[p + rng.uniform(-0.5, 0.5) for p in row] for row in prox]
    args = {"clip_eps": 0.2, "clip_hi": 0.28, "is_cap": 2.0, "eps": 1e-6}
    ref, ref_adv = reference_loss(logp, prox, behav, rewards, groups, mask, **args)

    adv = group_advantages(rewards, groups, eps=1e-6)
    assert adv == pytest.approx(ref_adv, abs=1e-9)
    assert adv[8:12] == [0.0] * 4
    f64 = {"dtype": torch.float64}
    loss, m = policy_loss(torch.tensor(logp, **f64), torch.tensor(prox, **f64), torch.tensor(behav, **f64),
                          torch.tensor(adv, **f64), torch.tensor(mask, **f64),
                          clip_eps=0.2, clip_eps_high=0.28, is_cap=2.0)
    assert abs(float(loss) - ref) < 1e-5
    assert 0 < m["clip_frac"] < 1 and 0 < m["is_truncated_frac"] < 1
    # float32 (what the trainer uses) agrees too
    loss32, _ = policy_loss(*(torch.tensor(x, dtype=torch.float32) for x in (logp, prox, behav)),
                            torch.tensor(adv, dtype=torch.float32), torch.tensor(mask),
                            clip_eps=0.2, clip_eps_high=0.28, is_cap=2.0)
    assert abs(float(loss32) - ref) < 1e-5


def test_gradient_pushes_up_positive_advantage_tokens():
    logp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    loss.backward()
    assert logp.grad[0, 0] < 0 < logp.grad[1, 0]  # descent raises logp of the A>0 token


def test_group_advantages_validate_lengths():
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0], ["a"])


@pytest.mark.parametrize(("clip_eps_high", "expected"), [(None, 3 / 4), (0.28, 2 / 4)])
def test_clip_frac_counts_ratios_outside_the_asymmetric_range(clip_eps_high, expected):
    # ratios 0.7 (below 1 - 0.2), 0.9 (inside), 1.25 (inside only with clip-higher 0.28), 1.5 (above);
    # a padding token far outside the range is not counted
    ratios = torch.tensor([[0.7, 0.9, 1.25, 1.5, 3.0]], dtype=torch.float64)
    prox = torch.full_like(ratios, -1.0)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.float64)
    _, m = policy_loss(prox + ratios.log(), prox, prox, torch.tensor([1.0], dtype=torch.float64), mask,
                       clip_eps=0.2, clip_eps_high=clip_eps_high)
    assert m["clip_frac"] == pytest.approx(expected)
