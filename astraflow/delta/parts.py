"""A version in parts: each part holds rows ``[lo, hi)`` of dim 0 of the tensors it names (a rank's
FSDP shard), stored as a codec delta and/or safetensors file of those rows under the tensors' full
names (:mod:`astraflow.delta.manifest`). Rows of a contiguous tensor are a contiguous view of it, so a
part's delta applies, with the unchanged codec, to the row views of a whole state dict, and its
anchor's rows are copied into them: a reader never needs the parts to agree with its own layout.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np
import torch

from astraflow.delta.bits import crc_concat
from astraflow.delta.codec import apply_inplace, validate_delta
from astraflow.delta.errors import DeltaCorruptError, DeltaError

StateDict = Mapping[str, torch.Tensor]
Rows = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class PartOf:
    """Which part of each version a publisher writes (its rank in a group of ``parts``)."""

    index: int
    """This part's index (the rank)."""
    parts: int
    """How many parts each version has (the world size)."""
    group: str
    """Names one publishing group (a trainer's life): the part records of another are not this one's."""

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.parts:
            raise ValueError(f"part {self.index} of {self.parts}")

    @property
    def writes_manifest(self) -> bool:
        return self.index == 0


def chunk_rows(n: int, index: int, parts: int) -> tuple[int, int]:
    """Rows of part ``index`` when ``n`` rows are split as ``torch.chunk`` (and FSDP2's ``Shard(0)``)
    splits them: ``ceil(n / parts)`` a part, the last ones shorter or empty."""
    size = -(-n // parts)
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def row_view(t: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``t`` (a view; a 0-dim tensor is its one row)."""
    if t.dim() == 0:
        if tuple(span) != (0, 1):
            raise DeltaCorruptError(f"rows {span} of a 0-dim tensor")
        return t
    return t[span[0]: span[1]]


def row_views(state: MutableMapping[str, torch.Tensor], rows: Rows | None) -> MutableMapping[str, torch.Tensor]:
    """The views of ``state`` a part with ``rows`` reads and writes (None: ``state`` itself, whose
    entries a delta may add, replace or remove)."""
    if rows is None:
        return state
    missing = sorted(rows.keys() - state.keys())
    if missing:
        raise DeltaCorruptError(f"a part holds rows of tensors the state lacks: {missing[:5]}")
    return {name: row_view(state[name], span) for name, span in rows.items()}


def combined_crcs(pieces: list[tuple[Rows, dict[str, int], dict[str, int]]]) -> dict[str, int]:
    """CRC-32C of each whole tensor from its parts' ``(rows, CRCs, bytes)``, combined in row order."""
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for rows, crcs, sizes in pieces:
        for name, (lo, _hi) in rows.items():
            spans.setdefault(name, []).append((lo, crcs[name], sizes[name]))
    out = {}
    for name, items in spans.items():
        items.sort()
        crc = items[0][1]
        for _lo, piece, size in items[1:]:
            crc = crc_concat(crc, piece, size)
        out[name] = crc
    return out


def apply_parts_inplace(state: MutableMapping[str, torch.Tensor],
                        parts: list[tuple[Rows | None, bytes | memoryview]], base_version: int,
                        names: list[str] | None = None) -> None:
    """Apply one version's delta parts to ``state`` (each to its rows, in place). Every part's format,
    checksums and base names/shapes are checked before the first is written, so a corrupt or truncated
    part, or a base that is not ``base_version`` (its bits), leaves ``state`` untouched. ``names``:
    each part's name (its key) for the error that refuses it."""
    if len(parts) == 1:  # one part: apply_inplace is all-or-nothing by itself (and checks the base once)
        try:
            apply_inplace(row_views(state, parts[0][0]), parts[0][1], base_version=base_version)
            return
        except DeltaError as exc:
            if names is None:
                raise
            raise type(exc)(f"{names[0]}: {exc}") from exc
    views = [(row_views(state, rows), blob) for rows, blob in parts]
    for check in (False, True):
        for i, (view, blob) in enumerate(views):
            try:
                if check:  # the bases were checked above; each written tensor is checked against its target
                    apply_inplace(view, blob, base_version=base_version, verify_base=False)
                else:
                    validate_delta(view, blob, base_version, verify_base=True)
            except DeltaError as exc:
                if names is None:
                    raise
                raise type(exc)(f"{names[i]}: {exc}") from exc


def flat_offset(t: torch.Tensor, rows: tuple[int, int] | None) -> int:
    """Flat position in ``t`` of the first element of its rows ``rows`` (None: 0)."""
    if rows is None or t.dim() == 0:
        return 0
    return rows[0] * (t[0].numel() if t.shape[0] else 0)


def to_whole(idx: np.ndarray | None, t: torch.Tensor, rows: tuple[int, int] | None) -> np.ndarray | None:
    """Flat positions within a part's rows of ``t`` as flat positions in ``t`` (None, every element of
    the rows: spelled out unless the rows are the whole tensor)."""
    offset = flat_offset(t, rows)
    if idx is None:
        if rows is None or (t.dim() and (rows[0], rows[1]) == (0, t.shape[0])) or t.dim() == 0:
            return None
        return np.arange(offset, offset + row_view(t, rows).numel(), dtype=np.int64)
    return idx + offset if offset else idx
