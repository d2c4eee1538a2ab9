"""The per-version manifest: what a version consists of, written last with a conditional put.

A version is *published* once its manifest exists; the objects it names were uploaded before it.
A version is stored in one or more **parts** (format 2): a single-rank trainer writes one part that
holds every tensor whole; each rank of a rank group writes the part of its own rows (dim 0 of each
tensor, the ranks' FSDP shards), so no rank ever gathers the model. A part names its own anchor and/or
delta object (a codec delta or safetensors file of its rows, under the tensors' full names) and the
CRC-32C of each of its row ranges. ``tensors`` holds CRC-32C of every *whole* target tensor (the
parts' CRCs combined, :func:`~astraflow.delta.bits.crc_concat`), so a version published in parts has
the same ``tensors`` and ``state_digest`` as the same weights published whole, and a reader checks a
state it assembled without trusting anything else. A manifest whose parts do not cover every row of
every tensor exactly once is refused when it is read.

Format 1 (one anchor and/or one delta, no parts), as older versions in a bucket have it, is read as
the one-part case.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MANIFEST_FORMAT = 2
"""2: versions stored in parts. 1: one anchor and/or one delta object (read as one part)."""


class ObjectInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    """Bucket key of the object."""
    bytes: int
    """Size of the object."""
    sha256: str
    """sha256 hex of the object's bytes (also in its S3 metadata, checked on every read)."""


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rows: dict[str, tuple[int, int]] | None = None
    """Tensor -> the rows ``[lo, hi)`` of its dim 0 this part holds (a 0-dim tensor: ``[0, 1)``,
    whole). None: every tensor whole (the only part of its version)."""
    anchor: ObjectInfo | None = None
    """Safetensors file of this part's rows at this version, if any."""
    delta: ObjectInfo | None = None
    """Codec delta of this part's rows, base -> version, if any."""
    tensors: dict[str, int] | None = None
    """CRC-32C of each of this part's row ranges at this version (None when it holds every tensor
    whole: then the manifest's ``tensors`` are its CRCs)."""

    @property
    def keys(self) -> list[str]:
        return [o.key for o in (self.anchor, self.delta) if o is not None]


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: int = MANIFEST_FORMAT
    """Manifest format version (1: older versions, read as one part)."""
    policy: str
    """Policy whose weights these are."""
    version: int
    """Weight version."""
    kind: Literal["anchor", "delta"]
    """``anchor`` if a full checkpoint is stored at this version (in every part; a delta may exist too)."""
    base: int | None = None
    """Version the deltas apply to (``version - 1``); None without deltas."""
    parts: list[Part]
    """Where the version's objects are, part by part (one part: every tensor whole)."""
    shapes: dict[str, list[int]] | None = None
    """Shape of each whole tensor (what the parts' rows must cover; absent in format 1)."""
    params: int
    """Elements in the state dict."""
    full_bytes: int
    """Size of the state dict's tensors (what a full transfer would move)."""
    changed: int | None = None
    """Elements whose bits changed since ``base`` (from the deltas)."""
    sparsity: float | None = None
    """Fraction of elements unchanged since ``base``."""
    tensors: dict[str, int]
    """CRC-32C of each whole target tensor's bits."""
    state_digest: str
    """sha256 over the sorted (name, CRC-32C) pairs: one checksum for the whole state."""
    created_at: float = Field(default_factory=time.time)
    """Unix time of publication."""

    @model_validator(mode="before")
    @classmethod
    def _one_part_of_format_1(cls, data: Any) -> Any:
        """A format-1 manifest (``anchor`` / ``delta`` at the top) is its version's one part."""
        if isinstance(data, dict) and "parts" not in data and ("anchor" in data or "delta" in data):
            data = dict(data)
            data["parts"] = [{"anchor": data.pop("anchor", None), "delta": data.pop("delta", None)}]
            data.setdefault("format", 1)
        return data

    @model_validator(mode="after")
    def _parts_cover_every_row(self) -> Manifest:
        check_parts(self)
        return self

    @property
    def has_anchor(self) -> bool:
        return all(p.anchor is not None for p in self.parts)

    @property
    def has_delta(self) -> bool:
        return self.base is not None and all(p.delta is not None for p in self.parts)

    @property
    def anchor_keys(self) -> list[str]:
        return [p.anchor.key for p in self.parts if p.anchor is not None]

    @property
    def delta_keys(self) -> list[str]:
        return [p.delta.key for p in self.parts if p.delta is not None]

    @property
    def anchor_bytes(self) -> int | None:
        return sum(p.anchor.bytes for p in self.parts) if self.has_anchor else None

    @property
    def delta_bytes(self) -> int | None:
        return sum(p.delta.bytes for p in self.parts) if self.has_delta else None

    @property
    def keys(self) -> list[str]:
        return [k for p in self.parts for k in p.keys]

    @property
    def bytes(self) -> int:
        return sum(o.bytes for p in self.parts for o in (p.anchor, p.delta) if o is not None)


def check_parts(m: Manifest) -> None:
    """Refuse (ValueError, so a pydantic ValidationError when read) parts that do not tile every
    tensor's rows exactly once, or that hold objects of different kinds."""
    if not m.parts:
        raise ValueError(f"v{m.version}: a manifest lists no part")
    if (any(p.anchor is None for p in m.parts) and any(p.anchor is not None for p in m.parts)) or (
            any(p.delta is None for p in m.parts) and any(p.delta is not None for p in m.parts)):
        raise ValueError(f"v{m.version}: some parts have an anchor (or a delta) and others not")
    if len(m.parts) == 1 and m.parts[0].rows is None:
        return
    if any(p.rows is None or p.tensors is None for p in m.parts) or m.shapes is None:
        raise ValueError(f"v{m.version}: a version in {len(m.parts)} parts must give each part's rows and CRCs "
                         "and the tensors' shapes")
    if set(m.shapes) != set(m.tensors):
        raise ValueError(f"v{m.version}: the shapes and the CRCs name different tensors")
    held: dict[str, list[tuple[int, int]]] = {name: [] for name in m.shapes}
    for i, part in enumerate(m.parts):
        if set(part.rows) != set(part.tensors):
            raise ValueError(f"v{m.version}: part {i} gives rows and CRCs of different tensors")
        for name, span in part.rows.items():
            if name not in held:
                raise ValueError(f"v{m.version}: part {i} holds {name!r}, which the version does not have")
            held[name].append(span)
    for name, spans in held.items():
        end, at = dim0(m.shapes[name]), 0
        for lo, hi in sorted(spans):
            if lo != at or hi < lo:
                break
            at = hi
        else:
            if at == end:
                continue
        raise ValueError(f"v{m.version}: the parts' rows of {name!r} ({sorted(spans)}) do not cover its "
                         f"{end} rows exactly once")


def dim0(shape: list[int]) -> int:
    """Rows of a tensor of ``shape`` as parts split it (a 0-dim tensor is one row)."""
    return shape[0] if shape else 1


def state_digest(crcs: dict[str, int]) -> str:
    text = "".join(f"{name}\t{crc:08x}\n" for name, crc in sorted(crcs.items()))
    return hashlib.sha256(text.encode()).hexdigest()
