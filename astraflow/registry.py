"""Name -> plug-in tables (datasets, workflows, rewards, dataflow plug-ins) that recipes name by a
string; filled by a ``register`` decorator when the plug-in's module is imported."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Plug-ins of one kind by name. A name taken by another object is refused, so two plug-ins
    can never silently shadow each other; unknown names fail with the registered ones listed."""

    def __init__(self, what: str, error: type[Exception] = ValueError) -> None:
        self.what = what
        """What the entries are, for errors ("dataset", "selector plug-in", ...)."""
        self.error = error
        """Exception raised for an unknown or doubly registered name."""
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
