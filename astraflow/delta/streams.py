"""Byte planes, gap-coded positions and zstd frames: how a tensor's change becomes small streams.

* Positions of changed elements are gap-coded (``gap = idx[i] - idx[i-1] - 1``) and stored at the
  narrowest fixed width (1, 2, 4 or 8 bytes) that holds the largest gap of that tensor.
* Every fixed-width array (gaps, XOR values) is split into byte planes (all low bytes, then all
  next bytes, ...): the high planes are almost all zeros and the low ones have a skewed byte
  distribution, which zstd's entropy stage exploits far better than interleaved bytes.
* Each plane is one zstd frame (level 1 by default: as small as level 3 on this data, and faster).
"""

from __future__ import annotations

import numpy as np
import zstandard

from astraflow.delta.errors import DeltaCorruptError

DEFAULT_LEVEL = 1
_GAP_WIDTHS = ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64))


def split_planes(arr: np.ndarray) -> list[np.ndarray]:
    """A 1-D integer array of itemsize k -> k contiguous uint8 planes (least significant first)."""
    k = arr.dtype.itemsize
    as_bytes = np.ascontiguousarray(arr).view(np.uint8).reshape(-1, k)
    return [np.ascontiguousarray(as_bytes[:, j]) for j in range(k)]


def join_planes(planes: list[np.ndarray], dtype: type, n: int) -> np.ndarray:
    """Inverse of :func:`split_planes`."""
    k = np.dtype(dtype).itemsize
    out = np.empty((n, k), dtype=np.uint8)
    for j, plane in enumerate(planes):
        out[:, j] = plane
    return out.reshape(-1).view(dtype)


def gap_code(idx: np.ndarray) -> np.ndarray:
    """Sorted flat positions -> gaps at the narrowest width that holds them."""
    gaps = np.diff(idx, prepend=-1)
    gaps -= 1
    return gaps.astype(gap_width_dtype(gap_width_for(int(gaps.max()) if gaps.size else 0)))


def gap_width_for(top: int) -> int:
    """The narrowest gap width (bytes) that holds ``top``, the largest gap."""
    for width, _ in _GAP_WIDTHS:
        if top < (1 << (8 * width)):
            return width
    raise AssertionError("unreachable: gaps fit in 8 bytes")


def gap_width_dtype(width: int) -> type:
    for w, dtype in _GAP_WIDTHS:
        if w == width:
            return dtype
    raise DeltaCorruptError(f"invalid gap width {width}")


def positions(gaps: np.ndarray) -> np.ndarray:
    """Inverse of :func:`gap_code`: gaps -> int64 flat positions."""
    idx = gaps.astype(np.int64)
    idx += 1
    np.cumsum(idx, out=idx)
    idx -= 1
    return idx


class PlaneCompressor:
    """zstd frames for byte planes; one compression context reused for every tensor."""

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = level
        self._zstd = zstandard.ZstdCompressor(level=level, write_checksum=False)

    def compress(self, plane: np.ndarray) -> bytes:
        if plane.size == 0:
            return b""
        return self._zstd.compress(plane)


class PlaneDecompressor:
    def __init__(self) -> None:
        self._zstd = zstandard.ZstdDecompressor()

    def decompress(self, frame: memoryview, raw_len: int) -> np.ndarray:
        if raw_len == 0:
            if len(frame):
                raise DeltaCorruptError("non-empty frame for an empty stream")
            return np.empty(0, dtype=np.uint8)
        try:
            raw = self._zstd.decompress(frame, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise DeltaCorruptError(f"stream does not decompress: {exc}") from None
        if len(raw) != raw_len:
            raise DeltaCorruptError(f"stream decompressed to {len(raw)} bytes, expected {raw_len}")
        return np.frombuffer(raw, dtype=np.uint8)
