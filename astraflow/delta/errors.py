"""Why a delta was refused. Every refusal leaves the base state dict untouched."""

from __future__ import annotations


class DeltaError(Exception):
    """Base class: this delta cannot be produced or applied."""


class DeltaFormatError(DeltaError):
    """Not a delta (bad magic), an unsupported format version, or an unsupported dtype."""


class DeltaCorruptError(DeltaError):
    """Truncated payload, a checksum mismatch, or a stream that does not decompress."""


class BaseVersionError(DeltaError):
    """The caller's base version is not the version this delta was computed from."""


class BaseMismatchError(DeltaError):
    """The base's tensor names, dtypes, shapes or contents are not those the delta expects."""
