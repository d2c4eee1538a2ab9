"""The three plug-in points of the dataflow and the registry that builds plug-ins by name.

A plug-in is one class registered with ``@register_plugin("name")`` under one of the three kinds
(:class:`TaskSelector` before rollout, :class:`TrajectoryFilter` after rollout,
:class:`BatchSampler` at batch serving). Its options are a pydantic model (``Options``), so a
recipe typo fails at start-up. Its state (``state_dict``) is checkpointed together with the log
offsets it reflects, so that a restarted dataflow continues exactly where it stopped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from astraflow.dataflow.group import Group
from astraflow.records import Task
from astraflow.registry import Registry


class PluginError(ValueError):
    """A recipe names an unknown plug-in or gives it invalid options."""


class PluginOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginSpec(BaseModel):
    """A plug-in as written in a recipe: ``{type: greso, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")
    type: str
    """Registered plug-in name."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options, validated by the plug-in's ``Options`` model."""

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        # ``filters: [dynamic_sampling]`` is shorthand for ``[{type: dynamic_sampling}]``.
        return {"type": data} if isinstance(data, str) else data


class Plugin(ABC):
    kind: ClassVar[str]
    name: ClassVar[str] = ""
    Options: ClassVar[type[PluginOptions]] = PluginOptions

    def __init__(self, options: PluginOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; stateless plug-ins return ``{}``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class TaskSelector(Plugin):
    """Before rollout: chooses which candidate tasks to emit, and learns from finished groups."""

    kind = "selector"

    @abstractmethod
    def select(self, candidates: list[Task], k: int) -> tuple[list[Task], list[Task]]:
        """Return (tasks to emit now, at most ``k``; tasks to skip for good). Candidates in neither
        list stay in the pool for a later call."""

    def observe(self, task: Task, policy: str, rewards: list[float]) -> None:
        """A group of ``task`` finished with these rewards (before rollout filters)."""

    def on_version(self, policy: str, version: int) -> None:
        """New weights were published."""


class TrajectoryFilter(Plugin):
    """After rollout: keeps or drops a complete group. The drop is counted under the filter name."""

    kind = "filter"

    @abstractmethod
    def keep(self, group: Group) -> bool: ...


class BatchSampler(Plugin):
    """At batch serving: buffers finished groups of one policy and chooses each batch's groups."""

    kind = "sampler"

    @abstractmethod
    def add(self, group: Group) -> None: ...

    @abstractmethod
    def sample(self, n_groups: int) -> list[Group] | None:
        """``n_groups`` groups for the next batch, or ``None`` when not enough are buffered."""

    def ahead_of(self, version: int) -> int:
        """Buffered groups that will be served before a group whose oldest token is at ``version``
        (the dataflow's staleness rule reads it). Arrival order: every buffered group."""
        return self.buffered()

    @abstractmethod
    def buffered(self) -> int:
        """Fresh groups waiting (not yet trained on)."""

    @abstractmethod
    def drain(self) -> list[Group]:
        """Remove and return every fresh buffered group (for accounting when stopping)."""


P = TypeVar("P", bound=Plugin)
_REGISTRY: dict[str, Registry[type[Plugin]]] = {
    kind: Registry(f"{kind} plug-in", PluginError) for kind in ("selector", "filter", "sampler")
}


def register_plugin(name: str) -> Callable[[type[P]], type[P]]:
    """Class decorator: make a plug-in class buildable by ``name`` from a recipe."""

    def deco(cls: type[P]) -> type[P]:
        _REGISTRY[cls.kind].register(name)(cls)
        cls.name = name
        return cls

    return deco


def registered(kind: str) -> list[str]:
    return _REGISTRY[kind].names()


def build_plugin(kind: str, spec: PluginSpec | dict[str, Any] | str) -> Plugin:
    """Instantiate a plug-in of ``kind`` ("selector", "filter", "sampler") from its recipe entry."""
    if isinstance(spec, str):
        spec = PluginSpec(type=spec)
    elif isinstance(spec, dict):
        spec = PluginSpec.model_validate(spec)
    cls = _REGISTRY[kind].get(spec.type)
    try:
        options = cls.Options.model_validate(spec.options)
    except ValidationError as exc:
        raise PluginError(f"invalid options for {kind} plug-in {spec.type!r}:\n{exc}") from None
    return cls(options)
