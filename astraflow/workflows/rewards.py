"""Reward functions are plug-ins: ``fn(response_text, task) -> float``, registered by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astraflow.models.tokenizer import compact
from astraflow.registry import Registry

RewardFn = Callable[[str, Any], float]
REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    return REWARDS.register(name)


def get_reward(name: str) -> RewardFn:
    return REWARDS.get(name)


@register_reward("exact_match")
def exact_match(response: str, task: Any) -> float:
    """1.0 when the response equals the task's answer, ignoring whitespace."""
    return float(compact(response) == compact(task.answer))


@register_reward("numeric_match")
def numeric_match(response: str, task: Any) -> float:
    """1.0 when both parse as the same number (``07`` == ``7``); 0.0 when the response does not parse."""
    try:
        return float(float(compact(response)) == float(compact(task.answer)))
    except ValueError:
        return 0.0
