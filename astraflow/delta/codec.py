"""Bit-exact sparse deltas between two state dicts (name -> tensor).

``encode(old, new, base_version=v, target_version=w)`` walks ``new`` tensor by tensor. Each tensor
is compared as raw bits (bf16/fp16 as int16, fp32 as int32, ...; never float arithmetic), and
stored as one of:

* ``same``    — no bit changed: nothing but checksums;
* ``sparse``  — gap-coded flat positions + XOR of old and new bits, byte-split, zstd;
* ``dense``   — XOR of every element (when more than ``dense_fraction`` changed: no positions);
* ``full``    — the new bits, for a tensor that is new or whose dtype or shape changed;
* ``removed`` — in the base, not in the target.

Added, removed and reshaped tensors are therefore *stored*, not refused: a delta always turns its
base into exactly its target. Each entry carries CRC-32C of the base bits, the target bits and its
payload.

``apply`` / ``apply_inplace`` validate everything that can be validated before touching the base:
format and length (truncation), header and payload checksums, the caller's ``base_version``, the
base's names/dtypes/shapes, and (``verify_base=True``) the base's bits. Only then do they write,
and every written tensor is checked against its target checksum; should one still mismatch,
``apply_inplace`` undoes what it wrote (XOR is its own inverse) before raising, so a refused
delta leaves the base untouched either way.

Memory: one tensor at a time beyond the model (its mask, positions and streams); the delta
itself is ~1% of the model. CUDA tensors are compared, gathered and scattered on their device;
only positions, values and the bits needed for checksums cross to the host, where zstd runs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c
import numpy as np
import torch

from astraflow.delta.bits import (
    bits,
    checksum,
    dtype_from_name,
    dtype_name,
    host_bits,
    itemsize,
    np_int,
    tensor_checksum,
)
from astraflow.delta.errors import BaseMismatchError, BaseVersionError, DeltaCorruptError, DeltaError
from astraflow.delta.format import DeltaHeader, TensorEntry, pack, parse
from astraflow.delta.streams import (
    DEFAULT_LEVEL,
    PlaneCompressor,
    PlaneDecompressor,
    gap_code,
    gap_width_dtype,
    gap_width_for,
    join_planes,
    positions,
    split_planes,
)

StateDict = Mapping[str, torch.Tensor]
DENSE_FRACTION = 0.3
ENCODE_THREADS = 4
"""Tensors encoded at once (diff + zstd): a 1.5B model's 1% delta has ~50 MB of planes to compress."""


# -- encode ----------------------------------------------------------------------------------
def encode(
    old: StateDict,
    new: StateDict,
    *,
    base_version: int,
    target_version: int,
    level: int = DEFAULT_LEVEL,
    dense_fraction: float = DENSE_FRACTION,
    crcs_old: Mapping[str, int] | None = None,
    crcs_new: Mapping[str, int] | None = None,
    threads: int = ENCODE_THREADS,
    crcs_out: MutableMapping[str, int] | None = None,
) -> bytes:
    """The delta that turns ``old`` (version ``base_version``) into ``new`` bit for bit.

    ``crcs_old`` / ``crcs_new``: the tensors' CRC-32C where the caller already has them (a publisher
    knows its previous version's and has just computed this one's for the manifest), so they are not
    computed again. ``threads``: tensors diffed and compressed side by side (numpy, torch, crc32c and
    zstd release the GIL), at most ``2 * threads`` in flight, so memory stays a few tensors' worth.
    ``crcs_out``: filled with every tensor of ``new``'s CRC-32C (given or computed: on the host in the same
    pass as the diff), so a caller needing them for its manifest need not read the state again."""
    local = threading.local()

    def one(name: str, t_new: torch.Tensor) -> tuple[TensorEntry, bytes]:
        _check_tensor(name, t_new)
        t_old = old.get(name)
        if t_old is not None:
            _check_tensor(name, t_old)
        if t_old is None or t_old.dtype != t_new.dtype or t_old.shape != t_new.shape:
            entry, planes = _encode_full(name, t_old, t_new)
        else:
            crc_old = crcs_old[name] if crcs_old is not None else None
            crc_new = crcs_new[name] if crcs_new is not None else None
            entry, planes = _encode_change(name, t_old, t_new, dense_fraction, crc_old, crc_new)
        if crcs_out is not None:
            crcs_out[name] = entry.crc_target
        if not hasattr(local, "zstd"):
            local.zstd = PlaneCompressor(level)
        frames = [local.zstd.compress(p) for p in planes]
        entry.streams = [[0, len(f), int(p.size)] for p, f in zip(planes, frames, strict=True)]
        record = b"".join(frames)
        entry.crc_payload = checksum(record)
        return entry, record

    entries: list[TensorEntry] = []
    payload: list[bytes] = []
    offset = 0
    pending: deque[Future] = deque()

    def take_oldest() -> None:
        nonlocal offset
        entry, record = pending.popleft().result()
        for stream in entry.streams:
            stream[0] = offset
            offset += stream[1]
        entries.append(entry)
        payload.append(record)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="delta-encode") as pool:
        for name, t_new in new.items():
            if len(pending) >= 2 * max(1, threads):
                take_oldest()
            pending.append(pool.submit(one, name, t_new))
        while pending:
            take_oldest()
    for name, t_old in old.items():
        if name not in new:
            _check_tensor(name, t_old)
            entries.append(
                TensorEntry(name, "removed", None, None, dtype_name(t_old.dtype), list(t_old.shape),
                            crc_base=tensor_checksum(t_old))
            )
    return pack(DeltaHeader(int(base_version), int(target_version), level, entries), payload)


def _check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise DeltaError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
    itemsize(t.dtype)  # raises DeltaFormatError for unsupported dtypes


def _encode_full(name: str, t_old: torch.Tensor | None, t_new: torch.Tensor) -> tuple[TensorEntry, list[np.ndarray]]:
    b = host_bits(t_new)
    entry = TensorEntry(
        name, "full", dtype_name(t_new.dtype), list(t_new.shape),
        None if t_old is None else dtype_name(t_old.dtype),
        None if t_old is None else list(t_old.shape),
        nnz=int(b.size),
        crc_base=0 if t_old is None else tensor_checksum(t_old),
        crc_target=checksum(b),
    )
    return entry, split_planes(b)


def _encode_change(
    name: str, t_old: torch.Tensor, t_new: torch.Tensor, dense_fraction: float,
    crc_old: int | None, crc_new: int | None,
) -> tuple[TensorEntry, list[np.ndarray]]:
    dt, shape = dtype_name(t_new.dtype), list(t_new.shape)
    entry = TensorEntry(name, "same", dt, shape, dt, shape)
    if t_old.device != t_new.device:
        t_old = t_old.to(t_new.device)
    if _on_host(t_new):  # the CRCs come out of the same pass over the bits as the diff
        entry.op, entry.nnz, entry.gap_width, planes, entry.crc_base, entry.crc_target = _diff_host(
            t_old, t_new, dense_fraction, crc_old, crc_new)
        return entry, planes
    entry.crc_base = tensor_checksum(t_old) if crc_old is None else crc_old
    entry.crc_target = tensor_checksum(t_new) if crc_new is None else crc_new
    entry.op, entry.nnz, entry.gap_width, planes = _diff_device(t_old, t_new, dense_fraction)
    return entry, planes


def _on_host(t: torch.Tensor) -> bool:
    """CPU tensors take the numpy path (faster single-threaded); others use torch ops on their device."""
    return t.device.type == "cpu"


HOST_CHUNK_BYTES = 1 << 20
"""Bytes of each tensor the host diff reads at a time: both tensors' chunk, their XOR and its mask (3.5 MiB)
stay in cache, so the 3 GB of a 1.5B model are read from memory once, not once per pass (1 MiB measured
faster than 256 KiB and 4 MiB here, 28 Nov 2026; fewer chunks also hold the GIL less often)."""


def _diff_host(t_old, t_new, dense_fraction, crc_old, crc_new):
    """(op, changed entries, gap width, byte planes, CRC-32C of old, of new) of two CPU tensors' bits, in one
    pass over both, chunk by chunk (:data:`HOST_CHUNK_BYTES`): XOR, positions of the non-zero words, their
    values and the CRCs (those not given) of each chunk while it is in cache."""
    a, b = host_bits(t_old), host_bits(t_new)
    n = a.size
    step = max(1, HOST_CHUNK_BYTES // a.itemsize)
    x_buf, m_buf = np.empty(min(n, step), a.dtype), np.empty(min(n, step), np.bool_)
    idx_parts, val_parts = [], []
    nnz, dense_at = 0, dense_fraction * n
    c_old, c_new = (0 if crc_old is None else crc_old), (0 if crc_new is None else crc_new)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        a_c, b_c = a[lo:hi], b[lo:hi]
        if crc_old is None:
            c_old = crc32c.crc32c(a_c, c_old)
        if crc_new is None:
            c_new = crc32c.crc32c(b_c, c_new)
        x = np.bitwise_xor(a_c, b_c, out=x_buf[: hi - lo])
        if idx_parts is None:  # dense already: only the count (and the CRCs above) goes on, no positions
            nnz += int(np.count_nonzero(x))
            continue
        i = np.flatnonzero(np.not_equal(x, 0, out=m_buf[: hi - lo]))
        nnz += i.size
        if nnz > dense_at:  # dense from here: the positions kept so far go
            idx_parts = val_parts = None
            continue
        if i.size:
            val_parts.append(x[i])
            i += lo
            idx_parts.append(i)
    if nnz == 0:
        return "same", 0, 0, [], c_old, c_new
    if idx_parts is None:
        return "dense", nnz, 0, split_planes(np.bitwise_xor(a, b)), c_old, c_new
    idx, vals = np.concatenate(idx_parts), np.concatenate(val_parts)
    gaps = gap_code(idx)
    return "sparse", nnz, gaps.dtype.itemsize, split_planes(gaps) + split_planes(vals), c_old, c_new


def _diff_device(t_old, t_new, dense_fraction):
    """The same as :func:`_diff_host`, computed where the tensors live (e.g. CUDA): XOR, sparsity scan,
    gap coding and the split into byte planes all run there, and only the planes (what zstd takes)
    cross to the host, in one copy."""
    x = bits(t_old.detach().contiguous()) ^ bits(t_new.detach().contiguous())
    nnz = int(torch.count_nonzero(x))
    if nnz == 0:
        return "same", 0, 0, []
    if nnz > dense_fraction * x.numel():
        return "dense", nnz, 0, list(_device_planes(x, x.element_size()).cpu().numpy())
    idx = torch.nonzero(x).squeeze(1)
    vals = x[idx]
    del x
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    gaps -= 1
    width = gap_width_for(int(gaps.max()))
    planes = torch.cat([_device_planes(gaps, width), _device_planes(vals, vals.element_size())])
    return "sparse", nnz, width, list(planes.cpu().numpy())


def _device_planes(x: torch.Tensor, width: int) -> torch.Tensor:
    """(width, n) uint8: byte plane j holds byte j (little-endian) of every element of ``x``."""
    return x.view(torch.uint8).view(-1, x.element_size())[:, :width].t().contiguous()


# -- apply -----------------------------------------------------------------------------------
def apply(
    base: StateDict,
    delta: bytes | memoryview,
    *,
    base_version: int | None = None,
    verify_base: bool = True,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """A new state dict equal bit for bit to the delta's target; ``base`` is never modified.

    ``base_version``: the version the caller believes ``base`` is (refused if it is not the delta's
    base). ``device``: where tensors that the delta stores in full and the base lacks are placed
    (default CPU); all others stay on their base tensor's device.
    """
    header, payload = validate_delta(base, delta, base_version, verify_base)
    dec = PlaneDecompressor()
    out: dict[str, torch.Tensor] = {}
    for entry in header.tensors:
        if entry.op == "removed":
            continue
        if entry.op == "full":
            t = _decode_full(entry, payload, dec, _full_device(base, entry, device))
        else:
            t = base[entry.name].detach().clone(memory_format=torch.contiguous_format)
            if entry.op != "same":
                _xor_into(t, entry, payload, dec)
        if entry.op != "same" or not verify_base:
            _verify_target(t, entry)
        out[entry.name] = t
    return out


def apply_inplace(
    base: MutableMapping[str, torch.Tensor],
    delta: bytes | memoryview,
    *,
    base_version: int | None = None,
    verify_base: bool = True,
    device: torch.device | str | None = None,
) -> MutableMapping[str, torch.Tensor]:
    """Turn ``base`` into the delta's target in place (tensors written in place; entries of new,
    reshaped or removed tensors replaced in the mapping). Returns ``base``. On refusal ``base`` is
    as it was."""
    header, payload = validate_delta(base, delta, base_version, verify_base)
    dec = PlaneDecompressor()
    undo: list[tuple[str, TensorEntry | torch.Tensor | None]] = []
    try:
        for entry in header.tensors:
            name = entry.name
            if entry.op == "same":
                if not verify_base:
                    _verify_target(base[name], entry)
            elif entry.op in ("sparse", "dense"):
                _xor_into(base[name], entry, payload, dec)
                undo.append(("xor", entry))
                _verify_target(base[name], entry)
            elif entry.op == "full":
                t = _decode_full(entry, payload, dec, _full_device(base, entry, device))
                _verify_target(t, entry)
                undo.append((name, base.get(name)))
                base[name] = t
            else:  # removed
                undo.append((name, base.pop(name)))
    except DeltaError:
        for name, saved in reversed(undo):
            if name == "xor":
                _xor_into(base[saved.name], saved, payload, dec)  # XOR twice = original bits
            elif saved is None:
                base.pop(name, None)
            else:
                base[name] = saved
        raise
    return base


def _full_device(base: StateDict, entry: TensorEntry, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    old = base.get(entry.name)
    return old.device if old is not None else torch.device("cpu")


def validate_delta(base: StateDict, delta, base_version: int | None, verify_base: bool) -> tuple[DeltaHeader, memoryview]:
    """The delta's header and payload, once everything checkable without writing is checked: format,
    checksums of header and payload, ``base_version``, the base's names/dtypes/shapes and
    (``verify_base``) the base's bits. Raises a :class:`DeltaError` otherwise."""
    header, payload = parse(delta)
    if base_version is not None and int(base_version) != header.base_version:
        raise BaseVersionError(
            f"delta v{header.base_version}->v{header.target_version} cannot apply to version {base_version}"
        )
    expected = {e.name: e for e in header.tensors if e.base_dtype is not None}
    missing = sorted(expected.keys() - base.keys())
    extra = sorted(base.keys() - expected.keys())
    if missing or extra:
        raise BaseMismatchError(
            f"base tensor names differ from the delta's base: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, entry in expected.items():
        t = base[name]
        if not isinstance(t, torch.Tensor):
            raise BaseMismatchError(f"base {name!r} is a {type(t).__name__}, not a tensor")
        if dtype_name(t.dtype) != entry.base_dtype or list(t.shape) != entry.base_shape:
            raise BaseMismatchError(
                f"base {name!r} is {dtype_name(t.dtype)}{list(t.shape)}, "
                f"the delta expects {entry.base_dtype}{entry.base_shape}"
            )
    _check_payload(header, payload)
    if verify_base:
        for name, entry in expected.items():
            if tensor_checksum(base[name]) != entry.crc_base:
                raise BaseMismatchError(
                    f"base {name!r} does not hold the bits of version {header.base_version} (checksum mismatch)"
                )
    return header, payload


def _check_payload(header: DeltaHeader, payload: memoryview) -> None:
    pos = 0
    for entry in header.tensors:
        if entry.op not in ("same", "sparse", "dense", "full", "removed"):
            raise DeltaCorruptError(f"unknown op {entry.op!r} for {entry.name!r}")
        if entry.op != "removed":
            dtype_from_name(entry.dtype)
        start = pos
        for off, clen, _raw in entry.streams:
            if off != pos or clen < 0:
                raise DeltaCorruptError(f"stream table of {entry.name!r} is inconsistent")
            pos += clen
        if pos > len(payload) or checksum(payload[start:pos]) != entry.crc_payload:
            raise DeltaCorruptError(f"payload of {entry.name!r} is corrupt (checksum mismatch)")
    if pos != len(payload):
        raise DeltaCorruptError(f"payload has {len(payload) - pos} bytes no tensor accounts for")


def _planes(entry: TensorEntry, payload: memoryview, dec: PlaneDecompressor) -> list[np.ndarray]:
    return [dec.decompress(payload[off : off + clen], raw) for off, clen, raw in entry.streams]


def _xor_into(t: torch.Tensor, entry: TensorEntry, payload: memoryview, dec: PlaneDecompressor) -> None:
    """XOR the entry's change into ``t``'s bits, in place, on ``t``'s device."""
    idx, vals = decode_change(entry, payload, dec, itemsize(t.dtype))
    scatter_xor(t, idx, vals)


def decode_change(entry: TensorEntry, payload: memoryview, dec: PlaneDecompressor,
                  size: int) -> tuple[np.ndarray | None, np.ndarray]:
    """A sparse or dense entry's change as (flat positions, or None for every element; XOR bits),
    checked against the entry's own shape. ``size``: the tensor's item size in bytes."""
    planes = _planes(entry, payload, dec)
    n = entry.numel
    if entry.op == "sparse":
        w = entry.gap_width
        if len(planes) != w + size or any(p.size != entry.nnz for p in planes):
            raise DeltaCorruptError(f"sparse streams of {entry.name!r} are inconsistent")
        idx = positions(join_planes(planes[:w], gap_width_dtype(w), entry.nnz))
        if idx.size and (idx[-1] >= n):
            raise DeltaCorruptError(f"positions of {entry.name!r} run past its {n} elements")
        vals = join_planes(planes[w:], np_int(size), entry.nnz)
    else:
        if len(planes) != size or any(p.size != n for p in planes):
            raise DeltaCorruptError(f"dense streams of {entry.name!r} are inconsistent")
        idx, vals = None, join_planes(planes, np_int(size), n)
    return idx, vals


def scatter_xor(t: torch.Tensor, idx: np.ndarray | None, vals: np.ndarray) -> None:
    """XOR ``vals`` into ``t``'s bits at flat positions ``idx`` (every element when None), in place."""
    target = t if t.is_contiguous() else t.contiguous()
    if _on_host(target):
        arr = bits(target).numpy()
        if idx is None:
            arr ^= vals
        else:
            arr[idx] ^= vals
    else:
        flat = bits(target)
        v = torch.from_numpy(vals).to(flat.device)
        if idx is None:
            flat ^= v
        else:
            i = torch.from_numpy(idx).to(flat.device)
            flat.index_put_((i,), flat[i] ^ v)
    if target is not t:
        t.copy_(target)


def _decode_full(entry: TensorEntry, payload: memoryview, dec: PlaneDecompressor, device: torch.device) -> torch.Tensor:
    dtype = dtype_from_name(entry.dtype)
    size = itemsize(dtype)
    planes = _planes(entry, payload, dec)
    if len(planes) != size or any(p.size != entry.numel for p in planes):
        raise DeltaCorruptError(f"full streams of {entry.name!r} are inconsistent")
    arr = join_planes(planes, np_int(size), entry.numel)
    t = torch.from_numpy(arr).view(dtype).reshape(entry.shape)
    return t.to(device) if device.type != "cpu" else t


def _verify_target(t: torch.Tensor, entry: TensorEntry) -> None:
    if tensor_checksum(t) != entry.crc_target:
        raise DeltaCorruptError(f"{entry.name!r} does not match its target checksum after apply")
