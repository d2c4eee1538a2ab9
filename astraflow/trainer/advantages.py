"""From a batch's rewards to one advantage per trajectory: the reward shaping (DAPO's overlong
penalty, a KL penalty folded into the reward) and the estimators of
:class:`~astraflow.trainer.objective.ObjectiveConfig` (``advantage``). Plain Python on floats: the
batch is at most a few thousand trajectories, and every rank computes the same numbers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from astraflow.trainer.objective import ObjectiveConfig, OverlongConfig


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-6,
                     scale_by_std: bool = True) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the group's population std
    (+eps); without ``scale_by_std`` (Dr. GRPO) the mean is subtracted only.

    A group whose rewards are all equal gets zero advantages (it carries no learning signal).
    """
    groups = _groups(rewards, group_ids)
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


def leave_one_out_advantages(rewards: Sequence[float], group_ids: Sequence[str]) -> list[float]:
    """RLOO: each reward minus the mean of the other rewards of its group (0 for a group of one)."""
    groups = _groups(rewards, group_ids)
    sums = {g: sum(rs) for g, rs in groups.items()}
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        k = len(groups[g])
        out.append(float(r) - (sums[g] - float(r)) / (k - 1) if k > 1 else 0.0)
    return out


def batch_normalised_advantages(rewards: Sequence[float], tokens: Sequence[float], eps: float) -> list[float]:
    """REINFORCE++: the reward (every token of a trajectory carries its return, the outcome reward)
    normalised by the mean and population std over the batch's loss tokens."""
    total = sum(tokens)
    if total <= 0:
        return [0.0 for _ in rewards]
    mean = sum(r * n for r, n in zip(rewards, tokens, strict=True)) / total
    std = math.sqrt(sum(n * (r - mean) ** 2 for r, n in zip(rewards, tokens, strict=True)) / total)
    return [(float(r) - mean) / (std + eps) for r in rewards]


def advantages(objective: ObjectiveConfig, rewards: Sequence[float], group_ids: Sequence[str],
               tokens: Sequence[float], eps: float) -> list[float]:
    """The advantage of each trajectory under ``objective.advantage``; ``tokens``: each one's loss
    tokens; ``eps``: the backend's ``adv_eps`` (added to a std before dividing by it)."""
    if not len(rewards) == len(group_ids) == len(tokens):
        raise ValueError(f"{len(rewards)} rewards, {len(group_ids)} group ids, {len(tokens)} token counts")
    if objective.advantage == "grpo":
        return group_advantages(rewards, group_ids, eps=eps)
    if objective.advantage == "dr_grpo":
        return group_advantages(rewards, group_ids, eps=eps, scale_by_std=False)
    if objective.advantage == "rloo":
        return leave_one_out_advantages(rewards, group_ids)
    return batch_normalised_advantages(rewards, tokens, eps)


def overlong_penalty(length: float, cfg: OverlongConfig) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens (0 or negative)."""
    start = cfg.max_tokens - cfg.buffer
    if length <= start:
        return 0.0
    if length <= cfg.max_tokens:
        return cfg.penalty * (start - length) / cfg.buffer
    return -cfg.penalty


def _groups(rewards: Sequence[float], group_ids: Sequence[str]) -> dict[str, list[float]]:
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    groups: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_ids, strict=True):
        groups[g].append(float(r))
    return groups
