"""CRC-32C of a tensor's bits computed where the tensor lives (e.g. on the GPU): 4 bytes a block come back.

A CUDA trainer or node checks every version's tensors against their CRC-32C. Copying 3 GB of bf16
weights to the host to checksum them costs more than the whole step-to-serving budget, so the CRC is
computed on the device with the algebra zlib's ``crc32_combine`` rests on. With the register's
initial value and final XOR taken out ("raw" CRC, initial value 0) the CRC is linear over GF(2):

* a block of ``BLOCK`` bytes: ``raw = XOR_i T[i][byte_i]``, where ``T[i][b]`` is the raw CRC of byte
  ``b`` followed by ``BLOCK - 1 - i`` zero bytes: one table gather and an XOR reduction per block, for
  every block of the tensor at once;
* two pieces: ``raw(A + B) = Z_|B|(raw(A)) XOR raw(B)``, ``Z_n`` the linear map "append n zero bytes";
* leading zero bytes do not change a raw CRC, so a tensor is padded at the front to whole blocks;
* the standard CRC-32C of n bytes is ``raw XOR crc32c(n zero bytes)``.

The blocks' CRCs (4 bytes per 4 KiB) come to the host, where numpy folds them pairwise, each level's
``Z`` applied as four byte-indexed tables. Checked against the ``crc32c`` package in the tests, on CPU
tensors (the same torch code runs on any device); CPU tensors normally take ``crc32c`` directly.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from astraflow.delta.bits import bits, crc_concat

BLOCK = 4096
"""Bytes a device block: its table (BLOCK x 256 x 4 bytes, 4 MiB) stays in the GPU's L2 cache."""
CHUNK_BLOCKS = 16384
"""Blocks gathered at once (64 MiB of the tensor): bounds the int32 indices and gathered words to 512 MiB."""
_POLY = 0x82F63B78


@functools.cache
def _byte_table() -> np.ndarray:
    """raw CRC-32C of each single byte (the reflected table)."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
    return t


def _append_zero_byte(v: np.ndarray) -> np.ndarray:
    return _byte_table()[v & 0xFF] ^ (v >> 8)


@functools.cache
def _position_table() -> np.ndarray:
    """``T[i][b]``: raw CRC of byte b at position i of a BLOCK-byte block, flattened (int32 bits)."""
    out = np.empty((BLOCK, 256), dtype=np.uint32)
    row = _byte_table().copy()
    for i in range(BLOCK - 1, -1, -1):
        out[i] = row
        row = _append_zero_byte(row)
    return out.reshape(-1).view(np.int32)


@functools.cache
def _device_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.from_numpy(_position_table().copy()).to(device)
    offsets = (torch.arange(BLOCK, dtype=torch.int32) * 256).to(device)
    return table, offsets


@functools.cache
def _zeros_tables(n_bytes: int) -> np.ndarray:
    """``Z_n`` as four 256-entry tables, one per byte of the register: Z(v) = XOR_k T[k][byte_k(v)]."""
    columns = np.array([crc_concat(1 << j, 0, n_bytes) for j in range(32)], dtype=np.uint32)
    tables = np.zeros((4, 256), dtype=np.uint32)
    b = np.arange(256)
    for k in range(4):
        for bit in range(8):
            tables[k, (b >> bit) & 1 == 1] ^= columns[8 * k + bit]
    return tables


def _apply_zeros(v: np.ndarray, n_bytes: int) -> np.ndarray:
    t = _zeros_tables(n_bytes)
    return t[0, v & 0xFF] ^ t[1, (v >> 8) & 0xFF] ^ t[2, (v >> 16) & 0xFF] ^ t[3, v >> 24]


def block_crcs(data: torch.Tensor) -> np.ndarray:
    """Raw CRC-32C of each BLOCK-byte block of ``data`` (flat uint8, a whole number of blocks), on its device."""
    table, offsets = _device_tables(data.device)
    rows = data.view(-1, BLOCK)
    out = []
    for lo in range(0, rows.shape[0], CHUNK_BLOCKS):
        idx = rows[lo: lo + CHUNK_BLOCKS].to(torch.int32)
        idx += offsets
        words = table.index_select(0, idx.view(-1)).view(idx.shape)
        del idx
        width = BLOCK
        while width > 1:  # XOR-reduce each block's words: halve the width until one is left
            width //= 2
            words = words[:, :width] ^ words[:, width: 2 * width]
        out.append(words[:, 0])
    return torch.cat(out).cpu().numpy().view(np.uint32)


def fold(crcs: np.ndarray, block_bytes: int) -> int:
    """The raw CRC of the concatenation of equal blocks whose raw CRCs are ``crcs``, in order."""
    v, size = crcs.astype(np.uint32), block_bytes
    while v.size > 1:
        if v.size % 2:  # a block of zeros in front: raw CRC 0, and it changes nothing
            v = np.concatenate([np.zeros(1, np.uint32), v])
        v = _apply_zeros(v[0::2], size) ^ v[1::2]
        size *= 2
    return int(v[0]) if v.size else 0


def device_crc32c(t: torch.Tensor) -> int:
    """CRC-32C of ``t``'s bits (little-endian element bytes), as ``crc32c.crc32c`` of its host copy gives."""
    if not t.is_contiguous():
        t = t.contiguous()
    data = bits(t).view(torch.uint8)
    n = data.numel()
    if n == 0:
        return 0
    pad = -n % BLOCK
    if pad:
        data = torch.cat([data.new_zeros(pad), data])
    raw = fold(block_crcs(data), BLOCK)
    return raw ^ _zeros_crc(n)


@functools.cache
def _zeros_crc(n: int) -> int:
    """crc32c(n zero bytes): the initial register carried through n zero bytes, then the final XOR."""
    return crc_concat(0xFFFFFFFF, 0, n) ^ 0xFFFFFFFF
