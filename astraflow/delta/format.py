"""The delta wire format: a fixed prelude, a JSON tensor table, then the compressed streams.

::

    offset  size  field
    0       8     magic  b"AFDELTA\\0"
    8       2     format version (u16, little-endian)
    10      2     flags (u16, 0)
    12      4     header length H (u32)
    16      8     payload length P (u64)
    24      4     CRC-32C of bytes [0, 24) + the header
    28      H     header: UTF-8 JSON {base_version, target_version, zstd_level, tensors: [...]}
    28+H    P     payload: every tensor's streams, back to back, in table order

A tensor entry (:class:`TensorEntry`) names its op, target and base dtype/shape, the number of
changed elements, its streams (offset in the payload, compressed length, raw length), CRC-32C of
the base bits, of the target bits and of its stretch of payload. The total length must be exactly
28 + H + P, so truncation is caught before anything is decompressed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Literal

from astraflow.delta.bits import checksum
from astraflow.delta.errors import DeltaCorruptError, DeltaFormatError

MAGIC = b"AFDELTA\0"
FORMAT_VERSION = 1
_PRELUDE = struct.Struct("<8sHHIQ")  # magic, version, flags, header len, payload len
_CRC = struct.Struct("<I")
PRELUDE_LEN = _PRELUDE.size + _CRC.size  # 28

# same: unchanged; sparse: gap-coded positions + XOR values; dense: XOR of every element;
# full: the target bits (new tensor, or dtype/shape changed); removed: not in the target.
Op = Literal["same", "sparse", "dense", "full", "removed"]


@dataclass
class TensorEntry:
    name: str
    op: Op
    dtype: str | None  # target dtype (None when removed)
    shape: list[int] | None
    base_dtype: str | None  # None when the tensor is new
    base_shape: list[int] | None
    nnz: int = 0  # changed elements
    gap_width: int = 0  # bytes per gap (sparse only)
    streams: list[list[int]] = field(default_factory=list)  # [offset, compressed len, raw len]
    crc_base: int = 0
    crc_target: int = 0
    crc_payload: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape or []:
            n *= d
        return n


@dataclass
class DeltaHeader:
    base_version: int
    target_version: int
    zstd_level: int
    tensors: list[TensorEntry]
    payload_len: int = 0

    @property
    def changed(self) -> int:
        return sum(t.nnz for t in self.tensors if t.op in ("sparse", "dense", "full"))

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors if t.op != "removed")

    @property
    def sparsity(self) -> float:
        """Fraction of target elements whose bits did not change."""
        return 1.0 - self.changed / self.numel if self.numel else 1.0


def pack(header: DeltaHeader, payload: list[bytes]) -> bytes:
    header.payload_len = sum(len(p) for p in payload)
    body = json.dumps(
        {
            "base_version": header.base_version,
            "target_version": header.target_version,
            "zstd_level": header.zstd_level,
            "tensors": [asdict(t) for t in header.tensors],
        },
        separators=(",", ":"),
    ).encode()
    prelude = _PRELUDE.pack(MAGIC, FORMAT_VERSION, 0, len(body), header.payload_len)
    crc = checksum(prelude + body)
    return b"".join([prelude, _CRC.pack(crc), body, *payload])


def parse(delta: bytes | memoryview) -> tuple[DeltaHeader, memoryview]:
    """Check prelude, length and header checksum; return the header and the payload view."""
    view = memoryview(delta)
    if len(view) < PRELUDE_LEN:
        raise DeltaCorruptError(f"delta truncated: {len(view)} bytes, shorter than its prelude")
    magic, version, flags, header_len, payload_len = _PRELUDE.unpack_from(view, 0)
    if magic != MAGIC:
        raise DeltaFormatError(f"not an AstraFlow delta (magic {bytes(magic)!r})")
    (crc,) = _CRC.unpack_from(view, _PRELUDE.size)
    expected = PRELUDE_LEN + header_len + payload_len
    if len(view) != expected:
        raise DeltaCorruptError(f"delta is {len(view)} bytes, its prelude says {expected} (truncated or corrupt)")
    body = view[PRELUDE_LEN : PRELUDE_LEN + header_len]
    if checksum(bytes(view[: _PRELUDE.size]) + bytes(body)) != crc:
        raise DeltaCorruptError("delta header checksum mismatch (corrupt)")
    if version != FORMAT_VERSION or flags != 0:
        raise DeltaFormatError(f"unsupported delta format version {version} (flags {flags}); this reader: {FORMAT_VERSION}")
    try:
        raw = json.loads(bytes(body))
        tensors = [TensorEntry(**t) for t in raw["tensors"]]
        header = DeltaHeader(raw["base_version"], raw["target_version"], raw["zstd_level"], tensors, payload_len)
    except (ValueError, KeyError, TypeError) as exc:
        raise DeltaCorruptError(f"delta header does not parse: {exc}") from None
    return header, view[PRELUDE_LEN + header_len :]


def read_header(delta: bytes | memoryview) -> DeltaHeader:
    """The tensor table of a delta (validated), without touching the payload."""
    return parse(delta)[0]
