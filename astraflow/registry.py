"""Name -> plug-in tables (datasets, workflows, rewards, tools, environments, dataflow plug-ins)
that recipes name by a string; filled by a ``register`` decorator when the plug-in's module is
imported.

A plug-in may carry typed options: a pydantic model (its ``Config``) whose ``type`` field is the
registered name. :meth:`Registry.parse` turns a recipe entry (``{type: calculator, timeout_s: 2}``
or the bare name ``calculator``) into that model, so a recipe section is a discriminated union on
``type`` that user plug-ins extend by registering a class, and :func:`plugin_field` makes it a
pydantic field type validated when the recipe loads.

An entry is the plug-in's class (with its ``Config``), or a :class:`Builder`: the options model and
a function that imports the plug-in's runtime (torch, vLLM, Megatron) only when it builds one, so
that validating a recipe never imports it (engines and trainer backends). A registry may name a
``default`` plug-in for an entry without ``type``, and ``connectors``: plug-ins shipped in a module
that registers them, imported when a recipe first names one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, Self, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, SerializeAsAny, ValidationError

T = TypeVar("T")
C = TypeVar("C", bound=type)
F = TypeVar("F", bound=Callable[..., Any])


class PluginConfig(BaseModel):
    """Options of one registered plug-in as written in a recipe: ``type`` names the plug-in, every
    other field is one of its typed options. Subclasses narrow ``type`` to ``Literal["<name>"]``."""

    model_config = ConfigDict(extra="forbid")
    type: str
    """Registered name of the plug-in."""

    def localized(self, base: Path | None) -> Self:
        """These options with the local paths they name resolved against ``base`` (the recipe's
        folder) and checked; raises ValueError naming the field. Plug-ins that name files override
        it (and call this one); nested plug-ins (a workflow's tools, reward, environment) are
        localized too."""
        update: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            try:
                if isinstance(value, PluginConfig):
                    update[name] = value.localized(base)
                elif isinstance(value, list) and any(isinstance(v, PluginConfig) for v in value):
                    update[name] = [_localized_item(v, base, i) for i, v in enumerate(value)]
            except ValueError as exc:
                raise ValueError(f"{name}{exc}" if str(exc).startswith("[") else f"{name}: {exc}") from None
        return self.model_copy(update=update) if update else self


def _localized_item(value: Any, base: Path | None, index: int) -> Any:
    if not isinstance(value, PluginConfig):
        return value
    try:
        return value.localized(base)
    except ValueError as exc:
        raise ValueError(f"[{index}]: {exc}") from None


@dataclass(frozen=True)
class Builder:
    """A registry entry that is not the plug-in's class: its options model and the function that
    builds it (and imports its runtime only when called): ``build(config, *args, **kwargs)``."""

    Config: type[PluginConfig]
    """The plug-in's options model (:meth:`Registry.parse` reads it)."""
    build: Callable[..., Any]
    """Builds the plug-in from its parsed options and the caller's arguments."""

    def __call__(self, config: PluginConfig, *args: Any, **kwargs: Any) -> Any:
        return self.build(config, *args, **kwargs)


class Registry(Generic[T]):
    """Plug-ins of one kind by name. A name taken by another object is refused, so two plug-ins
    can never silently shadow each other; unknown names fail with the registered ones listed."""

    def __init__(self, what: str, error: type[Exception] = ValueError, *, default: str | None = None,
                 connectors: Mapping[str, str] | None = None) -> None:
        self.what = what
        """What the entries are, for errors ("dataset", "selector plug-in", ...)."""
        self.error = error
        """Exception raised for an unknown or doubly registered name."""
        self.default = default
        """The plug-in an entry without ``type`` (or ``None``) names; ``None``: ``type`` is required."""
        self.connectors = dict(connectors or {})
        """Plug-ins shipped as connectors: name -> the module that registers it, imported when a
        recipe names it (it must import no runtime; the plug-in's options check it is installed)."""
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated class or function under ``name``."""

        def deco(obj: T) -> T:
            have = self._entries.get(name)
            if have is not None and have is not obj:
                owner = getattr(have, "__qualname__", repr(have))
                raise self.error(f"{self.what} {name!r} is already registered by {owner}")
            self._entries[name] = obj
            return obj

        return deco

    def register_class(self, name: str) -> Callable[[C], C]:
        """Class decorator: register the class under ``name`` and set its ``name`` attribute (the
        ``register_<kind>`` decorators of datasets, workflows, rewards, tools and environments)."""

        def deco(cls: C) -> C:
            self.register(name)(cls)  # type: ignore[arg-type]
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def register_builder(self, name: str, config: type[PluginConfig]) -> Callable[[F], F]:
        """Decorator: register ``build(config, *args, **kwargs)`` as plug-in ``name`` with options
        ``config`` (whose ``type`` must default to ``name``), as a :class:`Builder`."""
        if config.model_fields["type"].default != name:
            raise self.error(f"{self.what} {name!r}: {config.__name__}.type must default to {name!r}")

        def deco(build: F) -> F:
            self.register(name)(Builder(config, build))  # type: ignore[arg-type]  # T is Builder here
            return build

        return deco

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.what} {name!r}; registered: {self.names()}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    # -- typed options ----------------------------------------------------------------------------
    def config_class(self, name: str) -> type[PluginConfig]:
        """The options model of the plug-in registered under ``name`` (its ``Config`` attribute)."""
        cls = getattr(self.get(name), "Config", None)
        if not (isinstance(cls, type) and issubclass(cls, PluginConfig)):
            raise self.error(f"{self.what} {name!r} declares no Config (a PluginConfig subclass)")
        return cls

    def parse(self, data: Any) -> PluginConfig:
        """A recipe entry as the named plug-in's typed options: a bare name, a mapping with
        ``type`` (or without, for the ``default`` plug-in), or options already parsed (returned as
        they are). Errors name the plug-in and the offending option."""
        if isinstance(data, PluginConfig):
            if data.type in self._entries and type(data) is self.config_class(data.type):
                return data
            data = data.model_dump()
        if data is None and self.default is not None:
            data = {}
        if isinstance(data, str):
            data = {"type": data}
        if not isinstance(data, dict):
            # ValueError, not TypeError: pydantic reports only ValueErrors as field errors
            raise ValueError(f"a {self.what} is a name or a mapping with 'type', got {type(data).__name__}")  # noqa: TRY004
        if "type" not in data and self.default is not None:
            data = {"type": self.default, **data}
        name = data.get("type")
        if not isinstance(name, str):
            raise ValueError(f"a {self.what} needs a 'type' (one of {self.names()})")  # noqa: TRY004
        if name not in self._entries and name in self.connectors:
            self._import_connector(name)
        if name not in self._entries:
            raise ValueError(f"unknown {self.what} {name!r}; registered: {self.names()}")
        try:
            return self.config_class(name).model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'options'}: {e['msg']}"
                                 for e in exc.errors())
            raise ValueError(f"{self.what} {name!r}: {problems}") from None

    def _import_connector(self, name: str) -> None:
        module = self.connectors[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"{self.what} {name!r}: cannot import its connector {module!r}: {exc}") from None

    def build(self, config: PluginConfig | dict[str, Any] | str, *args: Any, **kwargs: Any) -> Any:
        """The plug-in named by ``config``, constructed with its parsed options first."""
        parsed = self.parse(config)
        return self.get(parsed.type)(parsed, *args, **kwargs)


def plugin_field(registry: Registry[Any]) -> Any:
    """A pydantic field type for one entry of ``registry``: parsed by :meth:`Registry.parse` at
    validation and serialised with all of the concrete options (not only ``type``)."""
    return Annotated[SerializeAsAny[PluginConfig], BeforeValidator(registry.parse)]
