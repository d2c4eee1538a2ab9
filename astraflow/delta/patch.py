"""Patching a serving engine's weights in place, with the engine paused only for the writes.

``apply_inplace`` decodes, writes and verifies tensor by tensor, and checks the base's bits first:
several passes over every byte of the model, all while the tensors are being written. A serving
engine cannot generate meanwhile. :class:`WeightPatch` splits the same work in three:

1. :func:`prepare_patch` (off to the side; the engine keeps generating): the delta chain from the
   version the engine holds (each version's parts, a rank group's rows, in the whole tensors' positions) is checked against the engine's tensors (names, dtypes, shapes, payload
   checksums, base version) and decoded to (positions, new bits) per changed tensor. The engine's
   tensors are read at those positions, never written. Memory: the decoded changes (~ the delta's
   size decompressed; one tensor for a dense change).
2. :meth:`WeightPatch.write` (the pause): only the changed entries are stored, the tensors split
   over threads (tensors are independent). Step 1 folded a chain of deltas into one change per
   tensor and read the current bits at the changed positions, so on the host the pause is a plain
   scatter of the new bits (~2.5x faster than XORing in place; XOR stays for CUDA tensors and dense
   changes).
3. :meth:`WeightPatch.verify` (after serving resumed): each changed tensor's CRC-32C against the
   trainer's target checksum. A mismatch means the engine's bits were not the base version's; the
   caller reloads a full checkpoint (``WeightFollower`` does). A corrupt *delta* never gets this far:
   its payload checksums are checked in step 1 and the delta is refused before any write.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from astraflow.delta.bits import bits, itemsize, storage_key, tensor_checksum
from astraflow.delta.codec import decode_change, scatter_xor, validate_delta
from astraflow.delta.errors import DeltaError
from astraflow.delta.format import TensorEntry, read_header
from astraflow.delta.parts import Rows, row_views, to_whole
from astraflow.delta.streams import PlaneDecompressor

StateDict = Mapping[str, torch.Tensor]


@dataclass
class TensorChange:
    """One tensor's change from the patch's base to its version. ``new_bits``: the bits to store at
    ``positions`` (a scatter, the fast case: a CPU tensor changed sparsely); otherwise ``xor``: bits
    to XOR in at ``positions`` (None: every element)."""

    name: str
    positions: np.ndarray | None
    new_bits: np.ndarray | None = None
    xor: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.positions, self.new_bits, self.xor) if a is not None)

    def write(self, t: torch.Tensor) -> None:
        if self.new_bits is not None:
            bits(t).numpy()[self.positions] = self.new_bits
        else:
            scatter_xor(t, self.positions, self.xor)


@dataclass
class WeightPatch:
    """The decoded delta chain ``base_version`` -> ``version`` for one engine's tensors."""

    base_version: int
    version: int
    changes: list[TensorChange] = field(default_factory=list)
    """One per changed tensor (a chain of deltas folded into one change each)."""
    crc_target: dict[str, int] = field(default_factory=dict)
    """CRC-32C of every tensor at ``version`` (the last delta's target checksums)."""
    bytes: int = 0
    """Bytes of the deltas downloaded for it."""

    @property
    def changed(self) -> list[str]:
        return sorted(c.name for c in self.changes)

    def write(self, live: MutableMapping[str, torch.Tensor], threads: int | None = None) -> None:
        """Write every change into ``live`` in place (the engine must not be reading it). Tied
        tensors (one storage under two names) are written once."""
        written = _distinct_storages(live, self.changed)
        _run(lambda c: c.write(live[c.name]), [c for c in self.changes if c.name in written], threads)

    def verify(self, live: StateDict, threads: int | None = None) -> list[str]:
        """Names of the changed tensors whose bits are not the target's (empty: bit-exact)."""
        names = self.changed
        ok = _run(lambda n: tensor_checksum(live[n]) == self.crc_target[n], names, threads)
        return [n for n, good in zip(names, ok, strict=True) if not good]


def prepare_patch(live: StateDict, deltas: list[tuple[int, list[tuple[Rows | None, bytes | memoryview]], dict[str, int]]],
                  base_version: int) -> WeightPatch:
    """Decode ``deltas`` (``(version, parts, CRCs)`` in order, the first from ``base_version``; each
    part ``(rows, blob)`` of that version, rows None for the whole state; CRCs: the version's whole
    tensors', from its manifest) against the tensor names, dtypes and shapes of ``live``, and fold them
    into one change per tensor, in the whole tensors' positions (so versions stored in different
    parts fold alike); ``live`` is read (the current bits at the changed positions), never written.
    Raises :class:`~astraflow.delta.errors.DeltaError` for a delta that is corrupt, does not follow
    on, or adds / removes / reshapes a tensor (those need a full load)."""
    patch = WeightPatch(base_version=base_version, version=base_version)
    # Every delta is checked (header, payload CRCs, base) before any entry is decoded; then the entries
    # are decompressed and decoded tensor by tensor, in parallel (zstd and numpy release the GIL).
    entries: dict[str, list[tuple[TensorEntry, memoryview, tuple[int, int] | None]]] = {}
    for version, parts, crcs in deltas:
        for rows, blob in parts:
            views = row_views(live, rows)
            header, payload = validate_delta(views, blob, patch.version, verify_base=False)
            if header.target_version != version:
                raise DeltaError(f"the delta stored as v{version} targets v{header.target_version}")
            for entry in header.tensors:
                if entry.op in ("full", "removed"):
                    raise DeltaError(f"v{version} {entry.op} tensor {entry.name!r}: a full load is needed")
                if entry.op != "same":
                    entries.setdefault(entry.name, []).append(
                        (entry, payload, None if rows is None else rows[entry.name]))
        patch.crc_target = dict(crcs)
        patch.version = version
    local = threading.local()

    def decode_and_fold(name: str) -> TensorChange:
        # Folding reads the engine's current bits at the changed positions.
        if not hasattr(local, "dec"):
            local.dec = PlaneDecompressor()
        t = live[name]
        parts = []
        for entry, payload, span in entries[name]:
            idx, vals = decode_change(entry, payload, local.dec, itemsize(t.dtype))
            parts.append((to_whole(idx, t, span), vals))
        return _fold(name, t, parts)

    patch.changes = _run(decode_and_fold, list(entries), None)
    return patch


def one_part(version: int, blob: bytes | memoryview) -> tuple[int, list[tuple[None, bytes | memoryview]], dict[str, int]]:
    """A delta of a whole state (one part), as :func:`prepare_patch` takes it: its target CRCs from its header."""
    return version, [(None, blob)], {e.name: e.crc_target for e in read_header(blob).tensors}


def _fold(name: str, t: torch.Tensor, parts: list[tuple[np.ndarray | None, np.ndarray]]) -> TensorChange:
    """One change equal to applying ``parts`` (XOR changes, in order) to ``t``."""
    if any(idx is None for idx, _ in parts):  # a dense change: XOR everything (one tensor of memory)
        xor = np.zeros(t.numel(), dtype=parts[0][1].dtype)
        for idx, vals in parts:
            if idx is None:
                xor ^= vals
            else:
                xor[idx] ^= vals
        return TensorChange(name, None, xor=xor)
    idx = np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
    vals = np.concatenate([v for _, v in parts]) if len(parts) > 1 else parts[0][1]
    # One version's parts (a rank group's rows, in row order) are non-overlapping ascending runs: their
    # concatenation is the fold. A chain's overlap: XORs compose, so sort the positions and XOR the
    # values of repeated ones together (the argsort doubled the node's decode when done for parts too).
    if not _disjoint_in_order(parts):
        order = np.argsort(idx, kind="stable")
        idx, vals = idx[order], vals[order]
        idx, starts = np.unique(idx, return_index=True)
        vals = np.bitwise_xor.reduceat(vals, starts)
    if t.device.type != "cpu" or not t.is_contiguous():
        return TensorChange(name, idx, xor=vals)
    return TensorChange(name, idx, new_bits=bits(t).numpy()[idx] ^ vals)


def _disjoint_in_order(parts: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    """Each part's positions start after the previous part's last (positions within a part ascend:
    they are gap-coded)."""
    last = -1
    for idx, _ in parts:
        if idx.size:
            if int(idx[0]) <= last:
                return False
            last = int(idx[-1])
    return True


def _distinct_storages(live: StateDict, names: list[str]) -> set[str]:
    """The first name of each storage among ``names`` (a tied LM head shares the embedding's)."""
    seen: set[tuple] = set()
    out: set[str] = set()
    for name in names:
        t = live[name]
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            out.add(name)
    return out


def _run(fn, items: list, threads: int | None) -> list:
    workers = min(threads or os.cpu_count() or 1, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers, thread_name_prefix="weight-patch") as pool:
        return list(pool.map(fn, items))
