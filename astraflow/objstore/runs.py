"""What a bucket holds per run (``astraflow runs ls | show``), from listings and Parquet footers only.

A run is a top-level prefix ``<run>/`` (docs/record-format.md, bucket layout): its areas are
``weights/<policy>/vNNNNNNNN/``, ``trainer/``, ``dataflow/``, ``claims/`` and ``archive/kind=<kind>/``.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.objstore import ObjectStore

log = logging.getLogger(__name__)
FOOTER_READ = 64 * 1024
"""Bytes fetched from a Parquet part's end: its footer, whose length is in the last 8 bytes."""


@dataclass
class RunSummary:
    run: str
    objects: int = 0
    bytes: int = 0
    last_modified: datetime | None = None
    area_bytes: Counter = field(default_factory=Counter)
    """``weights`` / ``trainer`` / ``dataflow`` / ``claims`` / ``archive`` / ``other`` -> bytes."""
    versions: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    """Policy -> weight versions published (sorted)."""
    archive_parts: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Archive kind -> keys of its Parquet parts."""
    checkpoint_pointers: dict[str, str] = field(default_factory=dict)
    """Policy -> key of its trainer's checkpoint pointer (its step: :func:`checkpointed_steps`)."""
    kept_checkpoints: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    """Policy -> the steps of its kept checkpoints (step folders with their copy of the pointer; sorted):
    what ``astraflow run --run-id R --from-checkpoint STEP`` may roll back to."""

    @property
    def policies(self) -> list[str]:
        return sorted(self.versions)

    def as_row(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "objects": self.objects,
            "mb": round(self.bytes / 1e6, 1),
            "policies": self.policies,
            "latest_version": {p: max(v) for p, v in self.versions.items() if v},
            "archived_parts": {k: len(v) for k, v in sorted(self.archive_parts.items())},
            "last_modified": self.last_modified.isoformat(timespec="seconds") if self.last_modified else None,
        }


def list_runs(store: ObjectStore, run: str | None = None) -> list[RunSummary]:
    """One summary per run in the bucket (or only ``run``), from one listing."""
    from astraflow.objstore.layout import STEP_POINTER, TRAINER_POINTER_FILE, parse_version

    runs: dict[str, RunSummary] = {}
    for obj in store.list_objects(f"{run}/" if run else ""):
        key = obj["Key"]
        name, _, rest = key.partition("/")
        if not rest:
            continue
        summary = runs.setdefault(name, RunSummary(name))
        summary.objects += 1
        summary.bytes += int(obj.get("Size", 0))
        modified = obj.get("LastModified")
        if modified is not None and (summary.last_modified is None or modified > summary.last_modified):
            summary.last_modified = modified
        area = rest.split("/", 1)[0]
        summary.area_bytes[area if area in ("weights", "trainer", "dataflow", "claims", "archive") else "other"] += \
            int(obj.get("Size", 0))
        parts = rest.split("/")
        if area == "weights" and len(parts) >= 4 and rest.endswith("manifest.json"):
            summary.versions[parts[1]].append(parse_version(key))
        elif area == "trainer" and len(parts) == 3 and parts[2] == TRAINER_POINTER_FILE:
            summary.checkpoint_pointers[parts[1]] = key
        elif (area == "trainer" and len(parts) == 4 and parts[3] == STEP_POINTER and parts[2].startswith("step-")
              and parts[2][len("step-"):].isdigit()):
            summary.kept_checkpoints[parts[1]].append(int(parts[2][len("step-"):]))
        elif area == "archive" and key.endswith(".parquet") and parts[1].startswith("kind="):
            summary.archive_parts[parts[1][len("kind="):]].append(key)
    for summary in runs.values():
        for versions in (*summary.versions.values(), *summary.kept_checkpoints.values()):
            versions.sort()
    return [runs[name] for name in sorted(runs)]


def checkpointed_steps(store: ObjectStore, summary: RunSummary) -> dict[str, int]:
    """Policy -> trainer step of its latest checkpoint (one small GET per policy)."""
    from astraflow.objstore import ObjectStoreError

    steps = {}
    for policy, key in sorted(summary.checkpoint_pointers.items()):
        try:
            steps[policy] = int(store.get_json(key)["step"])
        except (KeyError, TypeError, ValueError, ObjectStoreError) as exc:  # unreadable pointer: say so, go on
            log.warning("%s: no step (%s)", key, exc)
    return steps


def parquet_rows(store: ObjectStore, key: str) -> int:
    """Rows of a Parquet object, from its footer alone (one ranged GET, the whole object if small)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tail = store.get_tail(key, FOOTER_READ)
    if len(tail) < 12 or tail[-4:] != b"PAR1":
        raise ValueError(f"{key}: not a Parquet file")
    (footer_len,) = struct.unpack("<I", tail[-8:-4])
    if footer_len + 8 > len(tail):
        tail = store.get_tail(key, footer_len + 8)
    # The footer alone, framed as a file: read_metadata parses it without the data pages.
    return pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(footer_len + 8):])).num_rows


def archived_rows(store: ObjectStore, summary: RunSummary) -> dict[str, int]:
    """Archive kind -> rows, summed over its parts' footers."""
    return {kind: sum(parquet_rows(store, k) for k in keys) for kind, keys in sorted(summary.archive_parts.items())}
