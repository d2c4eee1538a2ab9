"""Weight plane: bit-exact sparse deltas (codec), versioned anchors and deltas in the bucket
(store), trainer-side publishing and rollout-side pulling."""

from astraflow.delta.announcement import carried_manifest
from astraflow.delta.codec import apply, apply_inplace, encode
from astraflow.delta.errors import (
    BaseMismatchError,
    BaseVersionError,
    DeltaCorruptError,
    DeltaError,
    DeltaFormatError,
    NoPathError,
    PublisherError,
    VersionExistsError,
    VersionNotFoundError,
    WeightStoreError,
)
from astraflow.delta.format import DeltaHeader, TensorEntry, read_header
from astraflow.delta.manifest import Manifest
from astraflow.delta.publisher import WeightPublisher
from astraflow.delta.retention import RetentionPolicy
from astraflow.delta.store import WeightStore
from astraflow.delta.subscriber import WeightSubscriber

__all__ = [
    "BaseMismatchError",
    "BaseVersionError",
    "DeltaCorruptError",
    "DeltaError",
    "DeltaFormatError",
    "DeltaHeader",
    "Manifest",
    "NoPathError",
    "PublisherError",
    "RetentionPolicy",
    "TensorEntry",
    "VersionExistsError",
    "VersionNotFoundError",
    "WeightPublisher",
    "WeightStore",
    "WeightStoreError",
    "WeightSubscriber",
    "apply",
    "apply_inplace",
    "carried_manifest",
    "encode",
    "read_header",
]
