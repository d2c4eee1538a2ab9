"""The seed of the episode running now: a node seeds each episode from the recipe's seed and its task,
and every ``generate`` of the episode's policies draws from a key derived from it and the call's
index in the episode (:mod:`astraflow.engines.seeding`).

A context variable, so a workflow (the shipped ones, a user's own) is seeded without passing a seed
around: each episode runs in its own asyncio task, which keeps its own copy. The same task then
samples the same tokens from the same weights, whichever node runs it and whatever runs beside it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from astraflow.engines.seeding import mix


@dataclass
class EpisodeSeed:
    seed: int
    calls: Iterator[int] = field(default_factory=itertools.count)
    """Index of the next ``generate`` call of this episode."""

    def next_call(self) -> int:
        """The seed of the episode's next ``generate`` call."""
        return mix(self.seed, next(self.calls))


_current: ContextVar[EpisodeSeed | None] = ContextVar("astraflow_episode_seed", default=None)


@contextmanager
def seeded_episode(*parts: int | str) -> Iterator[EpisodeSeed]:
    """Seed the episode running in this context from ``parts`` (e.g. the recipe's seed and the task id)."""
    episode = EpisodeSeed(mix(*parts))
    token = _current.set(episode)
    try:
        yield episode
    finally:
        _current.reset(token)


def next_call_seed() -> int | None:
    """The seed of this episode's next ``generate`` call; None outside a seeded episode."""
    episode = _current.get()
    return None if episode is None else episode.next_call()
