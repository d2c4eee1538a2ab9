"""Cheapest way, in bytes, from the version a subscriber holds to the version it wants.

Candidates: the chain of deltas ``have+1 .. want`` (one delta when one behind), and for every
anchor ``a <= want`` that anchor plus deltas ``a+1 .. want``. Walking back from ``want`` while
deltas exist prices them all in one pass. Ties go to fewer downloads. Objects named in ``avoid``
(ones a subscriber refused: corrupt, or not what their manifest names) are not used: a chain through
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
    key: str
    bytes: int


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
        if m.anchor is not None and m.anchor.key not in avoid:
            candidates.append([Step("anchor", v, m.anchor.key, m.anchor.bytes), *chain])
        for steps in candidates:
            cost = (sum(s.bytes for s in steps), len(steps))
            if best is None or cost < best[:2]:
                best = (*cost, steps)
        if m.delta is None or m.base != v - 1 or m.delta.key in avoid:
            break
        chain.insert(0, Step("delta", v, m.delta.key, m.delta.bytes))
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
