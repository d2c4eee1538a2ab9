"""Errors raised by the object-store layer. Every one is an :class:`ObjectStoreError`."""

from __future__ import annotations


class ObjectStoreError(RuntimeError):
    """The bucket could not be reached, refused a request, or returned something unusable."""


class ObjectStoreUnavailableError(ObjectStoreError):
    """The endpoint did not answer (connection refused, timeout) or answered "try again" (5xx):
    waiting may cure it, unlike a missing object, a refused credential or a checksum mismatch."""


class ObjectExistsError(ObjectStoreError):
    """A conditional put (``If-None-Match: *``) lost: the key already holds an object."""

    def __init__(self, key: str, message: str | None = None) -> None:
        self.key = key
        super().__init__(message or f"object already exists (conditional put refused): {key}")


class ObjectNotFoundError(ObjectStoreError):
    """The key does not exist in the bucket."""

    def __init__(self, key: str, message: str | None = None) -> None:
        self.key = key
        super().__init__(message or f"object not found: {key}")


class ChecksumError(ObjectStoreError):
    """The bytes read do not hash to the sha256 recorded when the object was written."""

    def __init__(self, key: str, expected: str | None, actual: str, message: str | None = None) -> None:
        self.key = key
        self.expected = expected
        self.actual = actual
        super().__init__(
            message or f"checksum mismatch for {key}: expected sha256 {expected}, got sha256 {actual}"
        )
