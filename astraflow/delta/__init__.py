"""Weight plane: bit-exact sparse deltas (codec), versioned anchors and deltas in the bucket
(store), trainer-side publishing and rollout-side pulling."""

from astraflow.delta.codec import apply, apply_inplace, encode
from astraflow.delta.errors import (
    BaseMismatchError,
    BaseVersionError,
    DeltaCorruptError,
    DeltaError,
    DeltaFormatError,
)
from astraflow.delta.errors import (
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
    "encode",
    "apply",
    "apply_inplace",
    "read_header",
    "DeltaHeader",
    "TensorEntry",
    "DeltaError",
    "DeltaFormatError",
    "DeltaCorruptError",
    "BaseVersionError",
    "BaseMismatchError",
    "Manifest",
    "RetentionPolicy",
    "WeightStore",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightStoreError",
    "VersionNotFoundError",
    "VersionExistsError",
    "NoPathError",
    "PublisherError",
]
