"""The three plug-in points of the dataflow and the registry that builds plug-ins by name.

A plug-in is one class registered with ``@register_plugin("name")`` under one of the three kinds
(:class:`TaskSelector` before rollout, :class:`TrajectoryFilter` after rollout,
:class:`BatchSampler` at batch serving). Its options are a pydantic model (``Options``). A recipe
names it with a :class:`PluginSpec` of its kind, which checks the name and parses the options into
that model when the recipe loads, so a typo is refused, naming the field, before any process
starts; the dataflow builds the plug-in from those parsed options. Its state (``state_dict``) is
checkpointed together with the log offsets it reflects, so that a restarted dataflow continues
exactly where it stopped.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from astraflow.dataflow.plugins.group import Group
from astraflow.records import Task
from astraflow.registry import Registry


class PluginError(ValueError):
    """A recipe names an unknown plug-in or gives it invalid options."""


class PluginOptions(BaseModel):
    # Frozen: one parsed options model is shared by every instance built from it (a sampler per policy).
    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginSpec(BaseModel):
    """A plug-in as written in a recipe: ``{type: greso, options: {...}}``, or the bare name
    ``greso``. Validated through its kind's subclass (:class:`SelectorSpec`, :class:`FilterSpec`,
    :class:`SamplerSpec`; :func:`validate_plugin` picks it): ``type`` must be registered and
    ``options`` becomes the plug-in's ``Options`` model, so errors name ``type`` or
    ``options.<field>``."""

    model_config = ConfigDict(extra="forbid")
    kind: ClassVar[str]
    """"selector", "filter" or "sampler": the registry ``type`` is looked up in."""
    type: str
    """Registered plug-in name."""
    options: SerializeAsAny[PluginOptions] = Field(default_factory=PluginOptions, validate_default=True)
    """Keyword options as the plug-in's ``Options`` model (a mapping in the recipe)."""

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        # ``filters: [dynamic_sampling]`` is shorthand for ``[{type: dynamic_sampling}]``.
        return {"type": data} if isinstance(data, str) else data

    @field_validator("type")
    @classmethod
    def _registered(cls, name: str) -> str:
        if not hasattr(cls, "kind"):
            raise TypeError("a plug-in entry is validated by its kind's spec: SelectorSpec, FilterSpec or SamplerSpec")
        _plugins(cls.kind).get(name)  # PluginError (a ValueError) listing the registered names
        return name

    @field_validator("options", mode="before")
    @classmethod
    def _typed_options(cls, options: Any, info: ValidationInfo) -> Any:
        name = info.data.get("type")
        if name is None:  # the type was refused: there is no Options model to check against
            return PluginOptions()
        model = _plugins(cls.kind).get(name).Options
        if type(options) is model:
            return options
        if isinstance(options, BaseModel):
            options = options.model_dump()
        # A ValidationError raised here is reported under ``options.<field>``.
        return model.model_validate(options)


class SelectorSpec(PluginSpec):
    """A recipe's ``dataflow.selector``."""

    kind: ClassVar[str] = "selector"


class FilterSpec(PluginSpec):
    """One of a recipe's ``dataflow.filters``."""

    kind: ClassVar[str] = "filter"


class SamplerSpec(PluginSpec):
    """A recipe's ``dataflow.sampler``."""

    kind: ClassVar[str] = "sampler"


SPECS: dict[str, type[PluginSpec]] = {s.kind: s for s in (SelectorSpec, FilterSpec, SamplerSpec)}
"""The spec model of each plug-in kind."""


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


def _plugins(kind: str) -> Registry[type[Plugin]]:
    """The registry of ``kind``, with the built-in plug-ins registered (their modules import this
    one, hence imported here on first use rather than at the top)."""
    importlib.import_module("astraflow.dataflow.plugins")
    return _REGISTRY[kind]


def register_plugin(name: str) -> Callable[[type[P]], type[P]]:
    """Class decorator: make a plug-in class buildable by ``name`` from a recipe."""

    def deco(cls: type[P]) -> type[P]:
        _REGISTRY[cls.kind].register(name)(cls)
        cls.name = name
        return cls

    return deco


def registered(kind: str) -> list[str]:
    return _plugins(kind).names()


def validate_plugin(kind: str, spec: PluginSpec | dict[str, Any] | str) -> PluginSpec:
    """A recipe entry of ``kind`` ("selector", "filter", "sampler") as its kind's spec, with the
    name checked and the options parsed; an entry validated already is returned as it is. Raises a
    pydantic ``ValidationError`` located at ``type`` or ``options.<field>``."""
    return SPECS[kind].model_validate(spec)


def build_plugin(kind: str, spec: PluginSpec | dict[str, Any] | str) -> Plugin:
    """Instantiate a plug-in of ``kind`` from its recipe entry: from the options parsed when the
    recipe loaded (a :class:`DataflowConfig`'s specs), or parsed now from a mapping or a name."""
    try:
        spec = validate_plugin(kind, spec)
    except ValidationError as exc:
        raise PluginError(_invalid(kind, spec, exc)) from None
    return _REGISTRY[kind].get(spec.type)(spec.options)


def _invalid(kind: str, spec: Any, exc: ValidationError) -> str:
    name = spec if isinstance(spec, str) else spec.get("type") if isinstance(spec, dict) else getattr(spec, "type", None)
    where = "options" if all(e["loc"][:1] == ("options",) for e in exc.errors()) else "entry"
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or kind}: {e['msg'].removeprefix('Value error, ')}"
                         for e in exc.errors())
    return f"invalid {where} for {kind} plug-in {name!r}: {problems}"
