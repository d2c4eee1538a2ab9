"""The environment contract: a stateful world an agent acts in over several turns.

An environment is a class registered by name with typed options (``Config``). One episode is
``start`` (first observation), then ``step`` per model action until ``done``, and ``cancel`` when the
episode ends early (turn or token limit, or the node stopping). An :class:`EnvironmentFailure`
(server down, protocol error) rejects the episode's whole GRPO group — never part of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from astraflow.registry import PluginConfig, Registry, plugin_field

if TYPE_CHECKING:
    from astraflow.records import Task


class EnvironmentConfig(PluginConfig):
    """Options of an environment plug-in."""


class EnvironmentFailure(Exception):
    """The environment could not run the episode (not the agent's fault)."""


@dataclass(frozen=True)
class EnvStart:
    episode_id: str
    """The environment's handle of the episode."""
    observation: str
    """The first observation (the task as the agent sees it)."""


@dataclass(frozen=True)
class EnvStep:
    observation: str
    reward: float
    done: bool


class Environment(ABC):
    name: ClassVar[str] = ""
    Config: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig

    def __init__(self, config: EnvironmentConfig) -> None:
        self.config = config

    @abstractmethod
    async def start(self, task: Task, sample_index: int) -> EnvStart: ...

    @abstractmethod
    async def step(self, episode_id: str, action: str) -> EnvStep: ...

    @abstractmethod
    async def cancel(self, episode_id: str) -> None: ...

    async def close(self) -> None:
        """Release resources (HTTP sessions)."""


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment")
EnvironmentField = plugin_field(ENVIRONMENTS)
"""Pydantic field type of a recipe's environment entry."""


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator: make a environment class buildable by ``name`` from a recipe."""
    return ENVIRONMENTS.register_class(name)


def build_environment(config: EnvironmentConfig | dict[str, Any] | str) -> Environment:
    return ENVIRONMENTS.build(config)
