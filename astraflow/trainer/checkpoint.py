"""Resumable trainer state in the bucket: model, optimizer, step/version, consumed batches.

Layout under ``<run>/trainer/<policy>/``::

    step-00000012/model.safetensors    weights (safetensors, fp32 as trained)
    step-00000012/optimizer.pt         optimizer state (torch.save)
    latest.json                        pointer, written LAST: step, version, the parts' sha256,
                                       the consumed offsets and the ids of the batches trained

Every object is written through ``ObjectStore`` (sha256 in its metadata, checked on read), and the
pointer repeats each part's sha256, so a torn, truncated or swapped checkpoint is refused with
:class:`CheckpointError` instead of resuming from garbage. Because the pointer is written last, a
crash mid-save leaves the previous checkpoint in force.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.objstore import ChecksumError, ObjectNotFoundError, ObjectStoreError, RunLayout

if TYPE_CHECKING:
    from astraflow.objstore import ObjectStore

POINTER = "latest.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be trusted (checksum mismatch, missing part, bad pointer)."""


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


class CheckpointStore:
    """Saves and loads :class:`TrainerCheckpoint` of one policy."""

    def __init__(self, store: ObjectStore, run: str, policy: str, *, keep_batch_ids: int = 10_000) -> None:
        self.store = store
        self.layout = RunLayout(run)
        self.policy = policy
        self.keep_batch_ids = keep_batch_ids

    def _key(self, name: str) -> str:
        return self.layout.trainer_key(self.policy, name)

    def save(self, ckpt: TrainerCheckpoint) -> dict[str, Any]:
        """Write the parts, then the pointer; returns the pointer document."""
        import torch
        from safetensors.torch import save as st_save

        prefix = f"step-{ckpt.step:08d}"
        model_bytes = st_save({k: v.detach().contiguous().cpu() for k, v in ckpt.model_state.items()})
        parts = {"model": (f"{prefix}/model.safetensors", model_bytes)}
        if ckpt.optimizer_state is not None:
            buf = io.BytesIO()
            torch.save(ckpt.optimizer_state, buf)
            parts["optimizer"] = (f"{prefix}/optimizer.pt", buf.getvalue())
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
            "time": time.time(),
        }
        self.store.put_json(self._key(POINTER), pointer)
        return pointer

    def exists(self) -> bool:
        return self.store.exists(self._key(POINTER))

    def load(self) -> TrainerCheckpoint | None:
        """The latest checkpoint, None if there is none; :class:`CheckpointError` if it is corrupt."""
        import torch
        from safetensors.torch import load as st_load

        try:
            pointer = self.store.get_json(self._key(POINTER))
        except ObjectNotFoundError:
            return None
        except ObjectStoreError as exc:  # checksum mismatch or not JSON
            raise CheckpointError(f"trainer checkpoint pointer {self._key(POINTER)} is corrupt: {exc}") from exc
        if not isinstance(pointer, dict) or pointer.get("format") != FORMAT or "model" not in pointer.get("parts", {}):
            raise CheckpointError(f"trainer checkpoint pointer {self._key(POINTER)} is not a format-{FORMAT} pointer")
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
        optimizer = None
        if "optimizer" in blobs:
            optimizer = torch.load(io.BytesIO(blobs["optimizer"]), map_location="cpu", weights_only=False)
        return TrainerCheckpoint(
            step=int(pointer["step"]),
            version=int(pointer["version"]),
            model_state=st_load(blobs["model"]),
            optimizer_state=optimizer,
            offsets={k: int(v) for k, v in pointer.get("offsets", {}).items()},
            batch_ids=list(pointer.get("batch_ids", [])),
        )
