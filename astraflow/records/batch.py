"""The Batch record: a training batch for one policy (``<run>.batches.<policy>``).

Serialised as the trajectory columns plus two batch columns, ``batch_id`` and ``trainer_version``
(constant over the rows), so that batch fields survive any Arrow operation that drops schema
metadata. A Batch is never empty. Rows keep group order: the trajectories of one ``group_id`` are
contiguous.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow as pa

from astraflow.records import trajectory as _traj
from astraflow.records.schema import RecordSchemaError, conform, with_identity
from astraflow.records.trajectory import Trajectory

SCHEMA_NAME = "astraflow.batch"
SCHEMA_VERSION = 1

BATCH_FIELDS = [
    pa.field("batch_id", pa.string(), nullable=False),
    pa.field("trainer_version", pa.int64(), nullable=False),
]
SCHEMA = with_identity(pa.schema(BATCH_FIELDS + _traj.FIELDS), SCHEMA_NAME, SCHEMA_VERSION)


@dataclass(slots=True)
class Batch:
    batch_id: str
    """Unique id; the record key on the batch topic (a trainer skips ids it already trained on)."""
    policy: str
    """Policy this batch trains."""
    trainer_version: int
    """Weight version current when the batch was assembled."""
    trajectories: list[Trajectory] = field(default_factory=list)
    """Whole groups, contiguous by ``group_id``."""

    def groups(self) -> dict[str, list[Trajectory]]:
        """Trajectories by ``group_id`` in batch order."""
        out: dict[str, list[Trajectory]] = defaultdict(list)
        for t in self.trajectories:
            out[t.group_id].append(t)
        return dict(out)

    def validate(self) -> None:
        if not self.batch_id:
            raise RecordSchemaError("Batch.batch_id is empty")
        if not self.trajectories:
            raise RecordSchemaError(f"Batch {self.batch_id} has no trajectories")
        wrong = {t.policy for t in self.trajectories} - {self.policy}
        if wrong:
            raise RecordSchemaError(f"Batch {self.batch_id} for {self.policy!r} holds policies {sorted(wrong)}")


def to_table(batch: Batch) -> pa.Table:
    """One Batch as an Arrow table in :data:`SCHEMA` (validated)."""
    batch.validate()
    cols = _traj._columns(batch.trajectories)
    n = len(batch.trajectories)
    cols = {"batch_id": [batch.batch_id] * n, "trainer_version": [batch.trainer_version] * n, **cols}
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def from_table(table: pa.Table) -> Batch:
    """The Batch held by ``table`` (one batch per table)."""
    table = conform(table, SCHEMA, SCHEMA_NAME, SCHEMA_VERSION)
    if table.num_rows == 0:
        raise RecordSchemaError("Batch table is empty")
    ids = table.column("batch_id").unique().to_pylist()
    versions = table.column("trainer_version").unique().to_pylist()
    if len(ids) != 1 or len(versions) != 1:
        raise RecordSchemaError(f"Batch table mixes batches {ids} / trainer versions {versions}")
    trajs = _traj._from_conformed(table.select([f.name for f in _traj.FIELDS]))
    batch = Batch(batch_id=ids[0], policy=trajs[0].policy, trainer_version=versions[0], trajectories=trajs)
    batch.validate()
    return batch
