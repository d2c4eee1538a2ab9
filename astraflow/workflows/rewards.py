"""Reward functions are plug-ins: ``fn(response_text, task) -> float``, registered by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astraflow.models.tokenizer import compact

RewardFn = Callable[[str, Any], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn
    return deco


def get_reward(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}") from None


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
