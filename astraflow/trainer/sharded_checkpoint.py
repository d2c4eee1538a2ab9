"""Trainer checkpoints through torch.distributed.checkpoint (DCP): format 3, any world size.

Save (every rank, on a ``CHECKPOINT`` turn): :func:`write_local` has DCP write this rank's shards of
the backend's :class:`~astraflow.trainer.base.ShardedState` into a local directory with
``HuggingFaceStorageWriter(save_distributed=True)``: safetensors files whose headers record each
shard's offsets, and no ``.metadata`` pickle. Then, off the training loop
(:mod:`astraflow.trainer.checkpoint_writer`), :func:`upload_rank` puts the files and a rank manifest
(their sha256) under ``<run>/trainer/<policy>/step-N/<save id>/``; rank 0 also puts the extras (param
groups, JSON), waits for every other rank's manifest and writes the pointer (``latest.json``, format
3) naming every file and digest, last. The save id (the leader's life and the step) keeps the files of
a save a crashed life left at the same step apart from this one's.

Load (every rank, any world size): :meth:`CheckpointStore.load` reads and checks the pointer and the
extras; :func:`restore` downloads every shard file, refuses one whose sha256 differs from the
pointer's (:class:`~astraflow.trainer.checkpoint.CheckpointError`, naming it), and lets DCP read them
into the backend's current layout (``HuggingFaceStorageReader``: the metadata comes from the
safetensors headers), resharding a checkpoint written at another world size. Every rank reads every
file: simple, and N times the bytes of one full checkpoint per resume (a reader that fetches only
the byte ranges a rank needs is the next step for large models).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.objstore import ChecksumError, ObjectNotFoundError

if TYPE_CHECKING:
    from astraflow.objstore import ObjectStore
    from astraflow.trainer.base import ShardedState, TrainerBackend
    from astraflow.trainer.checkpoint import CheckpointStore, TrainerCheckpoint
    from astraflow.trainer.distributed import RankGroup

log = logging.getLogger(__name__)

FORMAT = 3
"""Pointer format of a DCP checkpoint (2: one process's safetensors + JSON, 1: refused pickle)."""
MANIFEST_WAIT_S = 900.0
"""How long rank 0 waits for the other ranks' manifests before the save fails (a dead rank stops
the group long before: its agent ends the other workers)."""


@dataclass
class LocalShards:
    """One rank's part of a checkpoint, written by DCP to local disk, waiting to be uploaded."""

    save_id: str
    """Names this save's folder (the leader's life and the step): the same on every rank."""
    rank: int
    world_size: int
    directory: Path
    """DCP's output on local disk; removed once uploaded."""
    extras: dict[str, Any] = field(default_factory=dict)
    """The backend's JSON-able state (written by rank 0)."""


@dataclass
class StoredShards:
    """A format-3 checkpoint as its pointer describes it."""

    files: list[dict[str, Any]]
    """Every rank's files: ``{"key", "sha256", "bytes"}``."""
    extras: dict[str, Any]
    """The backend's JSON-able state, read and checked with the pointer."""
    world_size: int
    """Ranks that wrote it (a resume may use another number)."""


def write_local(state: ShardedState, group: RankGroup, save_id: str) -> LocalShards:
    """DCP-save ``state`` into a fresh local directory (collective on a rank group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    directory = Path(tempfile.mkdtemp(prefix=f"astraflow-dcp-{save_id}-r{group.rank}-"))
    with _one_process_is_intended():
        dcp.save(state.tensors, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True),
                 no_dist=not group.distributed)
    return LocalShards(save_id, group.rank, group.world_size, directory, dict(state.extras))


def upload_rank(checkpoints: CheckpointStore, ckpt: TrainerCheckpoint) -> dict[str, Any] | None:
    """Upload this rank's files and manifest; on rank 0 also the extras and, once every rank's
    manifest is there, the pointer (returned). None on the other ranks."""
    from astraflow.trainer.state_codec import encode_plain

    shards = ckpt.local_shards
    assert shards is not None
    folder = f"step-{ckpt.step:08d}/{shards.save_id}"
    store = checkpoints.store
    files = []
    for path in sorted(shards.directory.glob("*.safetensors")):
        key = checkpoints._key(f"{folder}/rank-{shards.rank:05d}/{path.name}")
        files.append({"key": key, "sha256": store.put_file(key, path), "bytes": path.stat().st_size})
    store.put_json(checkpoints._key(f"{folder}/rank-{shards.rank:05d}.json"),
                   {"format": FORMAT, "save_id": shards.save_id, "rank": shards.rank,
                    "world_size": shards.world_size, "files": files})
    shutil.rmtree(shards.directory, ignore_errors=True)
    if shards.rank != 0:
        return None
    extras_key = checkpoints._key(f"{folder}/extras.json")
    extras = encode_plain(shards.extras)
    extras_part = {"key": extras_key, "sha256": store.put_bytes(extras_key, extras), "bytes": len(extras)}
    for rank in range(1, shards.world_size):
        files += _wait_for_manifest(store, checkpoints._key(f"{folder}/rank-{rank:05d}.json"), shards)["files"]
    pointer = {
        "format": FORMAT,
        "policy": checkpoints.policy,
        "step": ckpt.step,
        "version": ckpt.version,
        "world_size": shards.world_size,
        "save_id": shards.save_id,
        "parts": {"shards": files, "extras": extras_part},
        "offsets": dict(ckpt.offsets),
        "batch_ids": list(ckpt.batch_ids[-checkpoints.keep_batch_ids:]),
        "topic_ids": dict(ckpt.topic_ids),
        "time": time.time(),
    }
    return pointer


@contextmanager
def _one_process_is_intended() -> Any:
    """DCP warns on every save and load without a process group that it assumes one process: we do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _wait_for_manifest(store: ObjectStore, key: str, shards: LocalShards) -> dict[str, Any]:
    deadline = time.monotonic() + MANIFEST_WAIT_S
    delay = 0.05
    while True:
        try:
            manifest = store.get_json(key)
        except ObjectNotFoundError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {shards.save_id}: no manifest {key} after {MANIFEST_WAIT_S:.0f} s "
                                   f"(did that rank die?)") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        if manifest.get("save_id") != shards.save_id or manifest.get("world_size") != shards.world_size:
            raise ValueError(f"checkpoint {shards.save_id}: manifest {key} belongs to another save")
        return manifest


def parse_pointer(checkpoints: CheckpointStore, pointer: dict[str, Any]) -> StoredShards:
    """The shard list and the extras of a format-3 pointer (the extras read and checked here)."""
    from astraflow.trainer.checkpoint_error import CheckpointError
    from astraflow.trainer.state_codec import StateFormatError, decode_plain

    where, step = checkpoints._key("latest.json"), pointer.get("step")
    parts = pointer.get("parts")
    if (not isinstance(parts, dict) or set(parts) != {"shards", "extras"} or not isinstance(parts["shards"], list)
            or not all(isinstance(f, dict) and {"key", "sha256"} <= set(f) for f in parts["shards"])
            or not isinstance(pointer.get("world_size"), int)):
        raise CheckpointError(f"trainer checkpoint pointer {where} is not a format-{FORMAT} pointer")
    info = parts["extras"]
    try:
        data, digest = checkpoints.store.get_bytes_with_sha256(info["key"])
    except (ChecksumError, ObjectNotFoundError, KeyError, TypeError) as exc:
        raise CheckpointError(f"trainer checkpoint step {step}: extras refused: {exc}") from exc
    if digest != info["sha256"]:
        raise CheckpointError(f"trainer checkpoint step {step}: {info['key']} does not match the sha256 recorded "
                              f"in the pointer; refusing to resume from it")
    try:
        extras = decode_plain(data)
    except StateFormatError as exc:
        raise CheckpointError(f"trainer checkpoint step {step}: {info['key']} refused: {exc}") from None
    return StoredShards(files=list(parts["shards"]), extras=extras, world_size=pointer["world_size"])


def restore(checkpoints: CheckpointStore, ckpt: TrainerCheckpoint, backend: TrainerBackend,
            group: RankGroup) -> None:
    """Load a format-3 checkpoint into ``backend`` (collective on a rank group): every file checked
    against the pointer, then read by DCP into the backend's current sharding."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from astraflow.trainer.checkpoint_error import CheckpointError

    stored = ckpt.stored_shards
    assert stored is not None
    state = backend.sharded_state()
    if state is None:
        raise CheckpointError(f"trainer checkpoint step {ckpt.step} was written through torch.distributed.checkpoint, "
                              f"which {type(backend).__name__} cannot load")
    directory = Path(tempfile.mkdtemp(prefix=f"astraflow-dcp-load-r{group.rank}-"))
    try:
        for i, info in enumerate(stored.files):
            target = directory / f"{i:05d}-{Path(info['key']).name}"
            try:
                digest = checkpoints.store.get_file(info["key"], target)
            except (ChecksumError, ObjectNotFoundError) as exc:
                raise CheckpointError(f"trainer checkpoint step {ckpt.step}: shard {info['key']} refused: {exc}") from exc
            if digest != info["sha256"]:
                raise CheckpointError(f"trainer checkpoint step {ckpt.step}: {info['key']} does not match the sha256 "
                                      f"recorded in the pointer; refusing to resume from it")
        try:
            with _one_process_is_intended():
                dcp.load(state.tensors, storage_reader=HuggingFaceStorageReader(str(directory)),
                         no_dist=not group.distributed)
        except Exception as exc:
            raise CheckpointError(f"trainer checkpoint step {ckpt.step}: torch.distributed.checkpoint could not "
                                  f"load its shards: {exc}") from exc
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    state.extras = stored.extras
    backend.load_sharded_state(state)
    log.info("trainer checkpoint step %d restored: %d files written by %d rank(s), loaded on %d", ckpt.step,
             len(stored.files), stored.world_size, group.world_size)
