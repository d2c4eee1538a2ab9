"""Reward plug-ins: ``reward(response_text, task) -> float``, registered by name with typed options.

A recipe names one as ``reward: exact_match`` or ``reward: {type: last_number, tolerance: 0.01}``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from astraflow.registry import PluginConfig, Registry, plugin_field
from astraflow.tasks.base import compact

if TYPE_CHECKING:
    from astraflow.records import Task


class RewardConfig(PluginConfig):
    """Options of a reward plug-in."""


class Reward(ABC):
    name: ClassVar[str] = ""
    Config: ClassVar[type[RewardConfig]] = RewardConfig

    def __init__(self, config: RewardConfig) -> None:
        self.config = config

    @abstractmethod
    def __call__(self, response: str, task: Task) -> float:
        """Reward of one decoded response to ``task`` (its reference answer is ``task.answer``)."""


REWARDS: Registry[type[Reward]] = Registry("reward")
RewardField = plugin_field(REWARDS)
"""Pydantic field type of a recipe's reward entry."""


def register_reward(name: str) -> Callable[[type[Reward]], type[Reward]]:
    def deco(cls: type[Reward]) -> type[Reward]:
        REWARDS.register(name)(cls)
        cls.name = name
        return cls
    return deco


def build_reward(config: RewardConfig | dict[str, Any] | str) -> Reward:
    return REWARDS.build(config)


@register_reward("exact_match")
class ExactMatch(Reward):
    """1.0 when the response equals the task's answer, ignoring whitespace."""

    class Config(RewardConfig):
        type: Literal["exact_match"] = "exact_match"

    def __call__(self, response: str, task: Task) -> float:
        return float(compact(response) == compact(task.answer))


@register_reward("numeric_match")
class NumericMatch(Reward):
    """1.0 when both parse as the same number (``07`` == ``7``); 0.0 when the response does not parse."""

    class Config(RewardConfig):
        type: Literal["numeric_match"] = "numeric_match"

    def __call__(self, response: str, task: Task) -> float:
        try:
            return float(float(compact(response)) == float(compact(task.answer)))
        except ValueError:
            return 0.0
