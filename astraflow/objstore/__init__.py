"""S3 layer: checksummed client, run key layout, atomic manifests."""

from astraflow.objstore.client import SHA256_META, ObjectStore, sha256_file
from astraflow.objstore.errors import (
    ChecksumError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)
from astraflow.objstore.layout import RunLayout, parse_version
from astraflow.objstore.manifest import publish_manifest, read_manifest

__all__ = [
    "SHA256_META",
    "ChecksumError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ObjectStore",
    "ObjectStoreError",
    "ObjectStoreUnavailableError",
    "RunLayout",
    "parse_version",
    "publish_manifest",
    "read_manifest",
    "sha256_file",
]
