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


class WeightStoreError(Exception):
    """The versioned weight store cannot do what was asked (see subclasses)."""


class VersionNotFoundError(WeightStoreError):
    """No published manifest for that version (never published, or garbage-collected)."""


class NoPathError(WeightStoreError):
    """No anchor + delta chain in the bucket reaches the wanted version."""


class VersionExistsError(WeightStoreError):
    """A different manifest is already published for that version (manifests are immutable)."""


class PublisherError(WeightStoreError):
    """The publisher's background thread failed; the original error is the ``__cause__``."""
