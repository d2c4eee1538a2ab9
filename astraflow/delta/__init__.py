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
from astraflow.delta.format import DeltaHeader, TensorEntry, read_header

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
]
