"""Atomic publication of manifests: a version, once published, can never be overwritten.

The manifest is written last (after the anchor/delta it names) with ``If-None-Match: *``, so of two
trainers racing to publish the same version exactly one wins and readers never see a manifest
change under them.
"""

from __future__ import annotations

import json
from typing import Any

from astraflow.objstore.client import ObjectStore
from astraflow.objstore.errors import ObjectExistsError


def publish_manifest(store: ObjectStore, key: str, obj: Any) -> str:
    """Write ``obj`` as JSON under ``key`` only if nothing is there; return the sha256 hex.

    Raises :class:`ObjectExistsError` if a *different* manifest already holds the key. Publishing the
    byte-identical manifest again succeeds (returns the same digest): a retry after a lost response,
    or a restarted trainer republishing the same version, is not an error.
    """
    try:
        return store.put_json(key, obj, if_none_match=True)
    except ObjectExistsError:
        mine = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
        theirs = store.get_bytes(key)
        if theirs == mine:
            return store.head(key)["sha256"] or ""
        raise


def read_manifest(store: ObjectStore, key: str) -> Any:
    """A published manifest, checksum-verified (raises ObjectNotFoundError if not published)."""
    return store.get_json(key)
