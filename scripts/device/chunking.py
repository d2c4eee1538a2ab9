"""Chunks for the GPU machine's transfers: pack files (split where needed) into numbered folders,
check each against the per-transfer limit, and verify / reassemble them from a manifest.

Shared by build_chunks.py (here) and receive.py (on the machine, Python 3.12, standard library only).
A chunk folder holds its files under their item names (``<name>`` whole, ``<name>.part-NN`` split)
and a copy of the whole build's manifest.json, so any one chunk tells the receiver what to expect.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
MANIFEST = "manifest.json"
MANIFEST_RESERVE = MIB // 4      # room kept in each chunk for its manifest copy
MIN_SPLIT = 4 * MIB              # below this much room left, a chunk is closed instead of a file split


class ChunkTooLarge(Exception):
    """A chunk plus the working tree that travels with it is over the per-transfer limit."""


class CorruptPart(Exception):
    """A chunk's file (or a reassembled item) does not match the manifest's size / sha256."""


@dataclass(frozen=True)
class Item:
    """One file to deliver: ``name`` is its path relative to the scratch folder on the machine."""

    name: str
    source: Path
    kind: str           # "wheel" | "xz-binary" | "gguf"
    group: str          # "rollout" | "vllm": installed as soon as all of a group's items are in
    size: int
    sha256: str


def sha256_file(path: Path, block: int = 4 * MIB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(block):
            h.update(data)
    return h.hexdigest()


def make_item(name: str, source: Path, kind: str, group: str) -> Item:
    return Item(name, Path(source), kind, group, Path(source).stat().st_size, sha256_file(source))


def plan(items: list[Item], capacity: int) -> list[list[dict]]:
    """Pieces per chunk, in order: each ``{"item", "offset", "length"}``. Items are packed in the
    order given (so the first group completes in the fewest transfers); one that does not fit the room
    left is split when at least MIN_SPLIT is left, else it starts the next chunk."""
    if capacity < MIN_SPLIT:
        raise ChunkTooLarge(f"only {capacity} bytes per chunk left under the limit: nothing fits")
    chunks: list[list[dict]] = [[]]
    room = capacity
    for item in items:
        offset = 0
        while True:
            left = item.size - offset
            if left > room and room < MIN_SPLIT:
                chunks.append([])
                room = capacity
            length = min(left, room)
            chunks[-1].append({"item": item, "offset": offset, "length": length})
            room -= length
            offset += length
            if offset >= item.size:
                break
    return [c for c in chunks if c]


def _copy_range(src: Path, dst: Path, offset: int, length: int, block: int = 4 * MIB) -> None:
    with open(src, "rb") as f, open(dst, "wb") as out:
        f.seek(offset)
        while length > 0:
            data = f.read(min(block, length))
            if not data:
                raise CorruptPart(f"{src} ended early (wanted {length} more bytes at {f.tell()})")
            out.write(data)
            length -= len(data)


def write_chunks(out: Path, items: list[Item], capacity: int, meta: dict) -> dict:
    """Write ``out/chunk-NN/`` folders and the manifest (also copied into each chunk); return it."""
    pieces = plan(items, capacity)
    split = {p["item"].name for chunk in pieces for p in chunk if p["length"] != p["item"].size}
    counters: dict[str, int] = {}
    manifest_items = {i.name: {"name": i.name, "kind": i.kind, "group": i.group, "size": i.size,
                               "sha256": i.sha256, "parts": []} for i in items}
    chunks = []
    if out.exists():
        shutil.rmtree(out)
    for k, chunk in enumerate(pieces, start=1):
        cname = f"chunk-{k:02d}"
        files = []
        for p in chunk:
            item = p["item"]
            if item.name in split:
                counters[item.name] = counters.get(item.name, 0) + 1
                rel = f"{item.name}.part-{counters[item.name]:02d}"
            else:
                rel = item.name
            dst = out / cname / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if item.name in split:
                _copy_range(item.source, dst, p["offset"], p["length"])
                digest = sha256_file(dst)
            else:
                shutil.copyfile(item.source, dst)
                digest = item.sha256
            entry = {"path": rel, "size": p["length"], "sha256": digest}
            files.append(entry)
            manifest_items[item.name]["parts"].append({"chunk": cname, **entry})
        chunks.append({"name": cname, "bytes": sum(f["size"] for f in files), "files": files})
    build_id = hashlib.sha256("".join(f"{i.name}:{i.sha256};" for i in items).encode()).hexdigest()[:12]
    manifest = {"format": 1, "build_id": build_id, **meta, "items": list(manifest_items.values()),
                "chunks": chunks}
    text = json.dumps(manifest, indent=1)
    (out / MANIFEST).write_text(text)
    for c in chunks:
        (out / c["name"] / MANIFEST).write_text(text)
    return manifest


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_limit(out: Path, tree_bytes: int, limit_bytes: int) -> list[tuple[str, int]]:
    """Each ``chunk-*`` folder's bytes on disk; raise naming every chunk whose bytes plus the
    working tree's are over the limit."""
    sizes = [(d.name, dir_bytes(d)) for d in sorted(out.glob("chunk-*")) if d.is_dir()]
    over = [(n, b) for n, b in sizes if b + tree_bytes > limit_bytes]
    if over:
        detail = ", ".join(f"{n}: {b} + tree {tree_bytes} = {b + tree_bytes} bytes" for n, b in over)
        raise ChunkTooLarge(f"over the {limit_bytes}-byte per-transfer limit: {detail}")
    return sizes


def verify_file(path: Path, size: int, sha256: str) -> None:
    if not path.is_file():
        raise CorruptPart(f"{path}: missing")
    if path.stat().st_size != size:
        raise CorruptPart(f"{path}: {path.stat().st_size} bytes, manifest says {size}")
    digest = sha256_file(path)
    if digest != sha256:
        raise CorruptPart(f"{path}: sha256 {digest}, manifest says {sha256}")


def verify_chunk(chunk_dir: Path, manifest: dict) -> dict:
    """Check every file the manifest lists for this chunk; return the chunk's entry."""
    entry = next((c for c in manifest["chunks"] if c["name"] == chunk_dir.name), None)
    if entry is None:
        raise CorruptPart(f"{chunk_dir.name} is not in manifest {manifest['build_id']}")
    for f in entry["files"]:
        verify_file(chunk_dir / f["path"], f["size"], f["sha256"])
    return entry


def assemble(item: dict, parts_dir: Path, dst: Path) -> None:
    """Join an item's parts (already in ``parts_dir`` under their paths) into ``dst``; check it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in item["parts"]:
            with open(parts_dir / part["path"], "rb") as f:
                shutil.copyfileobj(f, out, 4 * MIB)
    verify_file(tmp, item["size"], item["sha256"])
    tmp.replace(dst)
