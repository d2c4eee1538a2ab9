"""Tensors as raw bits: integer views of the same storage, host copies, checksums.

The codec never does float arithmetic: a bf16 tensor is handled as int16, fp32 as int32, so NaN
payloads and -0.0 survive bit for bit. Checksums are CRC-32C of the little-endian element bytes
(hardware accelerated: ~15 GB/s here, so verifying a whole model costs milliseconds).
"""

from __future__ import annotations

import functools
import sys

import crc32c
import numpy as np
import torch

from astraflow.delta.errors import DeltaFormatError

if sys.byteorder != "little":  # the wire format is little-endian byte planes
    raise ImportError("astraflow.delta supports little-endian hosts only")

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DeltaFormatError(f"unknown dtype {name!r} in delta")
    return dtype


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    size = dtype.itemsize
    if size not in _INT_VIEW or dtype.is_complex:
        raise DeltaFormatError(f"dtype {dtype} is not supported by the delta codec")
    return size


def np_int(size: int) -> type:
    return _NP_INT[size]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view sharing ``t``'s storage (``t`` must be contiguous)."""
    return t.detach().view(_INT_VIEW[itemsize(t.dtype)]).reshape(-1)


def storage_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors exactly when they are the same bits (tied weights under two names)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def host_bits(t: torch.Tensor) -> np.ndarray:
    """Flat integer numpy array of ``t``'s bits; shares memory when ``t`` is a contiguous CPU tensor."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    view = bits(t)
    return view.numpy() if view.device.type == "cpu" else view.cpu().numpy()


def checksum(arr: np.ndarray | bytes | memoryview) -> int:
    """CRC-32C of a contiguous buffer."""
    if isinstance(arr, np.ndarray):
        if arr.size == 0:
            return 0
        arr = np.ascontiguousarray(arr).view(np.uint8)
    return crc32c.crc32c(arr)


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC-32C of ``t``'s bits where ``t`` lives: a CPU tensor's buffer directly, another device's
    (e.g. CUDA) on that device, so only 4 bytes per 4 KiB block cross to the host."""
    if t.device.type == "cpu":
        return checksum(host_bits(t))
    from astraflow.delta.device_crc import device_crc32c

    return device_crc32c(t.detach())


# -- CRC-32C of a concatenation, from the CRCs of its pieces (zlib's crc32_combine, for CRC-32C) -------
# The crc32c package computes CRCs but cannot combine them; a tensor published in parts (row ranges,
# one per rank) has its whole CRC-32C combined from the parts' without any rank holding the whole.
_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.cache
def _zeros_operator(log2_bytes: int) -> list[int]:
    """The GF(2) matrix that appends ``2 ** log2_bytes`` zero bytes to a CRC-32C register."""
    if log2_bytes == 0:
        mat = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):  # 2, 4, 8 bits
            mat = [_gf2_times(mat, mat[n]) for n in range(32)]
        return mat
    half = _zeros_operator(log2_bytes - 1)
    return [_gf2_times(half, half[n]) for n in range(32)]


def crc_concat(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of ``a + b`` given CRC-32C of ``a``, of ``b`` and ``len(b)`` in bytes."""
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _gf2_times(_zeros_operator(k), crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
