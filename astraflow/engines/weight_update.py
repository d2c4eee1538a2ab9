"""The weight updates an engine receives (:meth:`Engine.update_weights <astraflow.engines.base.Engine.update_weights>`).

One method, three kinds of update; each engine lists the kinds it accepts in
``Engine.accepted_updates`` and the node's weight plane (:mod:`astraflow.raas.weights`) builds the
cheapest of them: a :class:`PublishedVersion` (the engine fetches the bytes itself), else an
:class:`InPlacePatch` (only the changed entries are written), else a :class:`FullState`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig


@dataclass(frozen=True)
class FullState:
    """Replace every weight with ``state_dict`` (published names); tokens after carry ``version``."""

    state_dict: dict[str, Any]
    version: int


@dataclass(frozen=True)
class InPlacePatch:
    """Run ``write(tensors)`` on the tensors the engine serves from (its ``state_dict()``, by their
    published names) between two decoding steps; tokens after carry ``version``. The engine pauses
    only for the writes: the deltas were fetched and decoded before (:mod:`astraflow.delta.patch`)."""

    write: Callable[[dict[str, Any]], None]
    version: int


@dataclass(frozen=True)
class PublishedVersion:
    """Fetch ``version`` of ``policy`` from ``cfg``'s bucket yourself (an engine in another process,
    e.g. a vLLM server whose workers read the bucket), registered there as ``subscriber_id``; tokens
    after carry ``version``. Raises :class:`~astraflow.delta.NoPathError` when the version cannot be
    reached."""

    cfg: ClusterConfig
    policy: str
    version: int
    subscriber_id: str


WeightUpdate = FullState | InPlacePatch | PublishedVersion
"""Any of the update kinds."""


class UpdateRefusedError(TypeError):
    """An engine was given an update kind that is not in its ``accepted_updates``."""

    def __init__(self, engine: object, kind: type) -> None:
        super().__init__(f"{type(engine).__name__} does not accept {kind.__name__} weight updates "
                         f"(it accepts {sorted(k.__name__ for k in getattr(engine, 'accepted_updates', ()))})")
