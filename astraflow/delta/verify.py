"""Check a policy's stored versions by recomputing checksums along the chain.

From the earliest anchor (or the first anchor at or after ``from_version``), every delta is
applied to the running state (the codec checks its payload and every target tensor's CRC-32C),
the result is compared with the manifest's per-tensor checksums (a version in parts: every part
applied to its rows, then the whole tensors checked), and at every anchor the anchor's
own bits are compared with both its manifest and the state the chain arrived at.
"""

from __future__ import annotations

from dataclasses import dataclass

from astraflow.delta.errors import DeltaError, WeightStoreError
from astraflow.delta.format import read_header
from astraflow.delta.parts import apply_parts_inplace
from astraflow.delta.store import WeightStore, check_state
from astraflow.objstore.errors import ObjectStoreError


@dataclass
class VersionCheck:
    version: int
    kind: str
    ok: bool | None  # None: not checked (before the first anchor in range)
    detail: str


def verify_chain(store: WeightStore, from_version: int | None = None) -> list[VersionCheck]:
    manifests = store.manifests()
    versions = [v for v in sorted(manifests) if from_version is None or v >= from_version]
    results: list[VersionCheck] = []
    state, at = None, None
    started = False
    for v in versions:
        m = manifests[v]
        notes = []
        started = started or m.has_anchor
        if not started:
            results.append(VersionCheck(v, m.kind, None, "skipped: before the first anchor in range"))
            continue
        try:
            if m.has_delta and state is not None and at == v - 1:
                parts = store.get_delta(v)
                for key, (_rows, blob) in zip(m.delta_keys, parts, strict=True):
                    header = read_header(blob)
                    if (header.base_version, header.target_version) != (v - 1, v):
                        raise DeltaError(f"{key} says v{header.base_version}->v{header.target_version}")
                apply_parts_inplace(state, parts, v - 1, names=m.delta_keys)
                check_state(state, m)
                at = v
                notes.append(f"delta from v{v - 1} applied ({len(parts)} part{'s' * (len(parts) > 1)}), "
                             f"{len(m.tensors)} tensor checksums match")
            if m.has_anchor:
                anchor = store.get_anchor(v)  # checked against the manifest
                if state is not None and at == v:
                    check_state(anchor, m)  # chain and anchor agree (state was checked above)
                    notes.append("anchor matches the chain")
                else:
                    notes.append("anchor checksums match")
                state, at = anchor, v
            if at != v:
                raise WeightStoreError(
                    "not reachable: no anchor here and no verified state at the delta's base"
                )
            results.append(VersionCheck(v, m.kind, True, "; ".join(notes)))
        except (DeltaError, WeightStoreError, ObjectStoreError) as exc:
            results.append(VersionCheck(v, m.kind, False, f"{type(exc).__name__}: {exc}"))
            state, at = None, None
    return results
