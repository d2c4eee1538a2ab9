"""Cheapest way, in bytes, from the version a subscriber holds to the version it wants.

Candidates: the chain of deltas ``have+1 .. want`` (one delta when one behind), and for every
anchor ``a <= want`` that anchor plus deltas ``a+1 .. want``. Walking back from ``want`` while
deltas exist prices them all in one pass. Ties go to fewer downloads. Objects named in ``avoid``
(ones a subscriber refused: corrupt, or not what their manifest names) are not used; a version
stored in parts is one step whose objects are all its parts': a chain through
an avoided delta is cut there, an avoided anchor is no candidate.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from astraflow.delta.errors import NoPathError, VersionNotFoundError
from astraflow.delta.manifest import Manifest


@dataclass(frozen=True)
class Step:
    kind: Literal["anchor", "delta"]
    version: int
    keys: tuple[str, ...]
    """The version's anchor or delta objects, one per part."""
    bytes: int

    @property
    def key(self) -> str:
        """The objects, for a log line (the one key of a one-part version)."""
        return ", ".join(self.keys)


@dataclass
class Plan:
    have: int | None
    want: int
    steps: list[Step] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)


def plan_path(manifests: Mapping[int, Manifest], have: int | None, want: int,
              avoid: Collection[str] = ()) -> Plan:
    avoid = set(avoid)
    if want not in manifests:
        raise VersionNotFoundError(f"version {want} is not published (or was garbage-collected)")
    if have == want:
        return Plan(have, want)
    best: tuple[int, int, list[Step]] | None = None  # (bytes, downloads, steps)
    chain: list[Step] = []  # deltas (v, want], newest last
    v = want
    while v in manifests:
        m = manifests[v]
        candidates = []
        if have is not None and have == v:
            candidates.append(list(chain))
        if m.has_anchor and avoid.isdisjoint(m.anchor_keys):
            candidates.append([Step("anchor", v, tuple(m.anchor_keys), m.anchor_bytes), *chain])
        for steps in candidates:
            cost = (sum(s.bytes for s in steps), len(steps))
            if best is None or cost < best[:2]:
                best = (*cost, steps)
        if not m.has_delta or m.base != v - 1 or not avoid.isdisjoint(m.delta_keys):
            break
        chain.insert(0, Step("delta", v, tuple(m.delta_keys), m.delta_bytes))
        v -= 1
    if have is not None and have == v and v not in manifests:
        # The subscriber holds v although its manifest is gone (GC): the deltas after it still work.
        cost = (sum(s.bytes for s in chain), len(chain))
        if best is None or cost < best[:2]:
            best = (*cost, list(chain))
    if best is None:
        raise NoPathError(f"no anchor + delta chain reaches version {want} from {have}"
                          + (f" without the refused {sorted(avoid)}" if avoid else ""))
    return Plan(have, want, best[2])
