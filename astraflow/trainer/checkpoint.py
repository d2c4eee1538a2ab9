"""Resumable trainer state in the bucket: model, optimizer, step/version, consumed batches.

Layout under ``<run>/trainer/<policy>/``::

    step-00000012/model.safetensors    weights (safetensors, fp32 as trained)
    step-00000012/optimizer.safetensors   optimizer tensors (moments, step counters as tensors)
    step-00000012/optimizer.json          the rest of the optimizer state (param groups, state keys)
    step-00000012/pointer.json            a copy of that step's pointer (what a rollback or a fall back loads)
    latest.json                        pointer, written LAST: step, version, the parts' sha256,
                                       the consumed offsets and the ids of the batches trained

Every object is written through ``ObjectStore`` (sha256 in its metadata, checked on read), and the
pointer repeats each part's sha256, so a torn, truncated or swapped checkpoint is refused with
:class:`CheckpointError` instead of resuming from garbage. Because the pointer is written last, a
crash mid-save leaves the previous checkpoint in force.

Retention (``keep_checkpoints``, the recipe's ``trainer.keep_checkpoints``): once the pointer names
step S, the step folders below the K newest at or below S are deleted (after the pointer write, so
a crash never leaves a pointer to deleted parts; folders above S, a crashed save's leftovers, are
left alone). :meth:`CheckpointStore.load` reads ``latest.json`` (or, given a step, that step's copy) and
refuses a corrupt checkpoint; the trainer then falls back to the next older kept one
(:meth:`TrainerService._resume_from_checkpoints <astraflow.trainer.service.TrainerService._resume_from_checkpoints>`).
The older K-1 are also there to roll back to: :meth:`CheckpointStore.roll_back` copies a step's
``pointer.json`` over ``latest.json`` (``astraflow run --run-id R --from-checkpoint STEP``). The batches
such a checkpoint would train again stay in the log: after each save the trainer holds the oldest kept
checkpoint's consumed offsets (:meth:`CheckpointStore.oldest_kept_offsets`) as the memberless group
``<run>.trainer-rollback.<policy>``, which log retention respects.

A backend with sharded state (the torch backend, at any world size) writes format 3 instead: its
model and optimizer through torch.distributed.checkpoint as safetensors shards, one folder per save
under ``step-N/``, the pointer naming every shard file and its sha256
(:mod:`astraflow.trainer.sharded_checkpoint`). Retention and the refusal of a corrupt checkpoint are
the same for both formats.

Nothing read back is unpickled (see :mod:`astraflow.trainer.state_codec`): a format-1 checkpoint,
whose optimizer state was a ``torch.save`` pickle, is refused with :class:`CheckpointError` naming
the object, because anyone who can write to the bucket could otherwise run code in the trainer.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.objstore import ChecksumError, ObjectNotFoundError, ObjectStoreError, RunLayout
from astraflow.objstore.layout import STEP_POINTER, TRAINER_POINTER_FILE
from astraflow.trainer import sharded_checkpoint
from astraflow.trainer.checkpoint_error import CheckpointError
from astraflow.trainer.sharded_checkpoint import LocalShards, StoredShards
from astraflow.trainer.state_codec import StateFormatError, decode_state, encode_state

if TYPE_CHECKING:
    from astraflow.objstore import ObjectStore

POINTER = TRAINER_POINTER_FILE
STEP_DIR_RE = re.compile(r"^step-(\d+)/")
log = logging.getLogger(__name__)
FORMAT = 2
"""2: optimizer state as safetensors + JSON; 1 (refused): optimizer state pickled by torch.save;
3: torch.distributed.checkpoint shards (:data:`astraflow.trainer.sharded_checkpoint.FORMAT`)."""


@dataclass
class TrainerCheckpoint:
    step: int
    """Optimizer steps taken (batches trained) in this lineage."""
    version: int
    """Weight version of ``model_state`` (as published)."""
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any] | None
    offsets: dict[str, int] = field(default_factory=dict)
    """``"<topic>:<partition>"`` -> next offset to read: every batch below it is in this state."""
    batch_ids: list[str] = field(default_factory=list)
    """Ids of the most recent batches trained (a re-sent batch with one of these ids is skipped)."""
    topic_ids: dict[str, str | None] = field(default_factory=dict)
    """Ids of the topics ``offsets`` point into: a re-created topic (a lost log) voids its offsets."""
    local_shards: LocalShards | None = None
    """To save as format 3: this rank's DCP files on local disk (``model_state`` is then empty)."""
    stored_shards: StoredShards | None = None
    """Loaded from a format-3 pointer: its shard files, to restore with
    :func:`astraflow.trainer.sharded_checkpoint.restore` (``model_state`` is then empty)."""


class CheckpointStore:
    """Saves and loads :class:`TrainerCheckpoint` of one policy."""

    def __init__(self, store: ObjectStore, run: str, policy: str, *, keep_batch_ids: int = 10_000,
                 keep_checkpoints: int | None = None) -> None:
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be >= 1 (or None: keep every checkpoint)")
        self.store = store
        self.layout = RunLayout(run)
        self.policy = policy
        self.keep_batch_ids = keep_batch_ids
        self.keep_checkpoints = keep_checkpoints
        """Step folders kept after each save (None: all of them)."""
        self.pruned_steps = 0
        """Step folders deleted by this store's saves so far."""
        self._saved_offsets: dict[int, dict[str, int]] = {}
        """Step -> the consumed offsets of the checkpoints this store saved and has not deleted."""
        self.oldest_kept: int | None = None
        """After a save: the oldest checkpoint step still kept at or below the one saved."""

    def _key(self, name: str) -> str:
        return self.layout.trainer_key(self.policy, name)

    def save(self, ckpt: TrainerCheckpoint) -> dict[str, Any] | None:
        """Write the parts, then the pointer; returns the pointer document (None on a rank other
        than 0 of a format-3 save, which writes only its own parts)."""
        if ckpt.local_shards is not None:
            pointer = sharded_checkpoint.upload_rank(self, ckpt)
            if pointer is not None:
                self._write_pointer(pointer)
            return pointer
        from safetensors.torch import save as st_save

        prefix = f"step-{ckpt.step:08d}"
        model_bytes = st_save({k: v.detach().contiguous().cpu() for k, v in ckpt.model_state.items()})
        parts = {"model": (f"{prefix}/model.safetensors", model_bytes)}
        if ckpt.optimizer_state is not None:
            tensors, skeleton = encode_state(ckpt.optimizer_state)
            parts["optimizer_tensors"] = (f"{prefix}/optimizer.safetensors", tensors)
            parts["optimizer_structure"] = (f"{prefix}/optimizer.json", skeleton)
        digests = {}
        for part, (name, data) in parts.items():
            digests[part] = {"key": self._key(name), "sha256": self.store.put_bytes(self._key(name), data),
                             "bytes": len(data)}
        pointer = {
            "format": FORMAT,
            "policy": self.policy,
            "step": ckpt.step,
            "version": ckpt.version,
            "parts": digests,
            "offsets": dict(ckpt.offsets),
            "batch_ids": list(ckpt.batch_ids[-self.keep_batch_ids:]),
            "topic_ids": dict(ckpt.topic_ids),
            "time": time.time(),
        }
        self._write_pointer(pointer)
        return pointer

    def _write_pointer(self, pointer: dict[str, Any]) -> None:
        """The step's copy, then ``latest.json`` (last), then retention."""
        self.store.put_json(self._step_pointer(pointer["step"]), pointer)
        self.store.put_json(self._key(POINTER), pointer)
        self._saved_offsets[pointer["step"]] = dict(pointer["offsets"])
        if self.keep_checkpoints is not None:
            self._prune(pointer["step"])  # strictly after the pointer: it never names deleted parts
        elif self.oldest_kept is None:  # every checkpoint kept: the oldest stays the oldest
            self.oldest_kept = min(self.kept_steps(), default=pointer["step"])

    def _step_pointer(self, step: int) -> str:
        return self._key(f"step-{step:08d}/{STEP_POINTER}")

    def _prune(self, pointed: int) -> None:
        """Delete the step folders older than the ``keep_checkpoints`` newest at or below ``pointed``
        (the step the pointer now names, always kept). A failure is logged, not raised: the
        checkpoint is durable, and the next save prunes what this one left."""
        root = self.layout.trainer_prefix(self.policy)
        try:
            folders: dict[int, list[str]] = {}
            for key in self.store.list(root):
                match = STEP_DIR_RE.match(key[len(root):])
                if match:
                    folders.setdefault(int(match.group(1)), []).append(key)
            held = sorted({pointed, *(s for s in folders if s <= pointed)})
            old = held[:-self.keep_checkpoints]
            self.store.delete_many(k for s in old for k in folders.get(s, ()))
            self.oldest_kept = held[-self.keep_checkpoints:][0]
            for s in old:
                self._saved_offsets.pop(s, None)
        except Exception as exc:  # noqa: BLE001 - pruning is housekeeping after a durable save
            log.warning("trainer %s: deleting checkpoints older than step %d failed (the next save tries "
                        "again): %s", self.policy, pointed, exc)
            return
        self.pruned_steps += len(old)
        if old:
            log.info("trainer %s: deleted checkpoint steps %s (keeping the %d newest up to step %d)",
                     self.policy, ", ".join(map(str, old)), self.keep_checkpoints, pointed)

    def exists(self) -> bool:
        return self.store.exists(self._key(POINTER))

    def load(self, step: int | None = None) -> TrainerCheckpoint | None:
        """The latest checkpoint (``step``: the kept one of that step, from its folder's copy of the
        pointer), None if there is none; :class:`CheckpointError` if it is corrupt."""
        where = self._key(POINTER) if step is None else self._step_pointer(step)
        try:
            pointer = self.store.get_json(where)
        except ObjectNotFoundError:
            return None
        except ObjectStoreError as exc:  # checksum mismatch or not JSON
            raise CheckpointError(f"trainer checkpoint pointer {where} is corrupt: {exc}") from exc
        if isinstance(pointer, dict) and pointer.get("format") == sharded_checkpoint.FORMAT:
            return self._sharded(pointer)
        self._check_pointer(pointer, where)
        blobs = {}
        for part, info in pointer["parts"].items():
            try:
                data, digest = self.store.get_bytes_with_sha256(info["key"])
            except (ChecksumError, ObjectNotFoundError) as exc:
                raise CheckpointError(f"trainer checkpoint step {pointer['step']}: {part} refused: {exc}") from exc
            if digest != info["sha256"]:
                raise CheckpointError(f"trainer checkpoint step {pointer['step']}: {info['key']} does not match "
                                      f"the sha256 recorded in the pointer; refusing to resume from it")
            blobs[part] = data
        step = pointer["step"]
        optimizer = None
        if "optimizer_tensors" in blobs or "optimizer_structure" in blobs:
            try:
                optimizer = decode_state(blobs["optimizer_tensors"], blobs["optimizer_structure"])
            except (KeyError, StateFormatError) as exc:
                keys = [pointer["parts"].get(p, {}).get("key") for p in ("optimizer_tensors", "optimizer_structure")]
                raise CheckpointError(f"trainer checkpoint step {step}: optimizer state {' + '.join(map(str, keys))} "
                                      f"refused (not safetensors + JSON as written by AstraFlow): {exc}") from None
        return TrainerCheckpoint(
            step=int(pointer["step"]),
            version=int(pointer["version"]),
            model_state=self._model_state(step, pointer["parts"]["model"]["key"], blobs["model"]),
            optimizer_state=optimizer,
            offsets={k: int(v) for k, v in pointer.get("offsets", {}).items()},
            batch_ids=list(pointer.get("batch_ids", [])),
            topic_ids={str(k): v for k, v in pointer.get("topic_ids", {}).items()},
        )

    def _sharded(self, pointer: dict[str, Any]) -> TrainerCheckpoint:
        """A format-3 checkpoint: its bookkeeping and shard list (the shards are read by ``restore``)."""
        stored = sharded_checkpoint.parse_pointer(self, pointer)
        try:
            return TrainerCheckpoint(
                step=int(pointer["step"]), version=int(pointer["version"]), model_state={}, optimizer_state=None,
                offsets={k: int(v) for k, v in pointer.get("offsets", {}).items()},
                batch_ids=list(pointer.get("batch_ids", [])),
                topic_ids={str(k): v for k, v in pointer.get("topic_ids", {}).items()}, stored_shards=stored)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"trainer checkpoint pointer {self._key(POINTER)} is not a checkpoint pointer: "
                                  f"{exc}") from None

    def _check_pointer(self, pointer: Any, where: str) -> None:
        """Refuse a pointer (the object ``where``) this version must not load, naming the object at fault."""
        if not isinstance(pointer, dict) or not isinstance(pointer.get("parts"), dict):
            raise CheckpointError(f"trainer checkpoint pointer {where} is not a checkpoint pointer")
        if pointer.get("format") == 1:
            pickled = pointer["parts"].get("optimizer", {}).get("key", where)
            raise CheckpointError(f"trainer checkpoint step {pointer.get('step')} is format 1: its optimizer state "
                                  f"{pickled} is a pickle, which AstraFlow does not load from the bucket (it could "
                                  f"run code in the trainer); start a new run id or delete {where}")
        if pointer.get("format") != FORMAT or "model" not in pointer["parts"]:
            raise CheckpointError(f"trainer checkpoint pointer {where} is not a format-{FORMAT} pointer")
        unknown = set(pointer["parts"]) - {"model", "optimizer_tensors", "optimizer_structure"}
        if unknown:
            raise CheckpointError(f"trainer checkpoint pointer {where} names unknown parts {sorted(unknown)}")

    def kept_steps(self) -> list[int]:
        """The steps of the checkpoints in the bucket (step folders with their copy of the pointer),
        oldest first."""
        root = self.layout.trainer_prefix(self.policy)
        steps = set()
        for key in self.store.list(root):
            match = STEP_DIR_RE.match(key[len(root):])
            if match and key.endswith(f"/{STEP_POINTER}") and key.count("/", len(root)) == 1:
                steps.add(int(match.group(1)))
        return sorted(steps)

    def oldest_kept_offsets(self) -> dict[str, int] | None:
        """After a save: the consumed offsets of the oldest checkpoint kept (the one a rollback may go
        furthest back to); None before the first save or when its pointer cannot be read."""
        step = self.oldest_kept
        if step is None:
            return None
        if step not in self._saved_offsets:  # saved by an earlier life
            try:
                self._saved_offsets[step] = {k: int(v) for k, v in self.store.get_json(self._step_pointer(step))
                                             .get("offsets", {}).items()}
            except (ObjectStoreError, AttributeError, TypeError, ValueError) as exc:
                log.warning("trainer %s: cannot read the offsets of kept checkpoint step %d: %s", self.policy,
                            step, exc)
                return None
        return self._saved_offsets[step]

    def roll_back(self, step: int) -> dict[str, Any]:
        """Make the kept checkpoint of ``step`` the latest (its folder's pointer copied over
        ``latest.json``): the trainer's next life resumes from it. Returns that pointer; refuses a step
        that has no kept checkpoint, naming those there are. The checkpoints above it stay until the
        resumed lineage's saves replace or prune them."""
        kept = self.kept_steps()
        if step not in kept:
            raise CheckpointError(f"trainer {self.policy}: no kept checkpoint at step {step} under "
                                  f"{self.layout.trainer_prefix(self.policy)} (kept: {kept or 'none'})")
        try:
            pointer = self.store.get_json(self._step_pointer(step))
        except ObjectStoreError as exc:
            raise CheckpointError(f"trainer checkpoint pointer {self._step_pointer(step)} is corrupt: {exc}") from exc
        self.store.put_json(self._key(POINTER), pointer)
        return pointer

    @staticmethod
    def _model_state(step: Any, key: str, data: bytes) -> dict[str, Any]:
        from safetensors import SafetensorError
        from safetensors.torch import load as st_load

        try:
            return st_load(data)
        except (SafetensorError, ValueError, RuntimeError) as exc:  # a corrupt or foreign object
            raise CheckpointError(f"trainer checkpoint step {step}: {key} is not a safetensors file: {exc}") from None
