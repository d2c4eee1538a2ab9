"""The per-version manifest: what a version consists of, written last with a conditional put.

A version is *published* once its manifest exists; the objects it names (an anchor, a delta, or
both) were uploaded before it. ``tensors`` holds CRC-32C of every target tensor's bits, so a
reader can check an anchor, and ``verify`` can check a chain, without trusting anything else.
"""

from __future__ import annotations

import hashlib
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_FORMAT = 1


class ObjectInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    """Bucket key of the object."""
    bytes: int
    """Size of the object."""
    sha256: str
    """sha256 hex of the object's bytes (also in its S3 metadata, checked on every read)."""


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: int = MANIFEST_FORMAT
    """Manifest format version."""
    policy: str
    """Policy whose weights these are."""
    version: int
    """Weight version."""
    kind: Literal["anchor", "delta"]
    """``anchor`` if a full checkpoint is stored at this version (a delta may exist too)."""
    base: int | None = None
    """Version the delta applies to (``version - 1``); None without a delta."""
    anchor: ObjectInfo | None = None
    """The full safetensors checkpoint, if any."""
    delta: ObjectInfo | None = None
    """The sparse delta base -> version, if any."""
    params: int
    """Elements in the state dict."""
    full_bytes: int
    """Size of the state dict's tensors (what a full transfer would move)."""
    changed: int | None = None
    """Elements whose bits changed since ``base`` (from the delta)."""
    sparsity: float | None = None
    """Fraction of elements unchanged since ``base``."""
    tensors: dict[str, int]
    """CRC-32C of each target tensor's bits."""
    state_digest: str
    """sha256 over the sorted (name, CRC-32C) pairs: one checksum for the whole state."""
    created_at: float = Field(default_factory=time.time)
    """Unix time of publication."""

    @property
    def keys(self) -> list[str]:
        return [o.key for o in (self.anchor, self.delta) if o is not None]

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in (self.anchor, self.delta) if o is not None)


def state_digest(crcs: dict[str, int]) -> str:
    text = "".join(f"{name}\t{crc:08x}\n" for name, crc in sorted(crcs.items()))
    return hashlib.sha256(text.encode()).hexdigest()
