"""The Task record: one prompt the dataflow emits to a RaaS pool (``<run>.tasks.<pool>``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from astraflow.records.schema import RecordSchemaError, conform, map_to_dict, with_identity

SCHEMA_NAME = "astraflow.task"
SCHEMA_VERSION = 1

SOURCE_ID_KEY = "source_prompt_id"
"""Metadata key holding the dataset prompt a task was drawn from, where ``prompt_id`` is unique per
draw (a recipe's endless stream, an epoch of the emitter); per-prompt plug-in statistics (GRESO's
history) are keyed by it, so they stay bounded by the dataset, not by the run's age."""

SCHEMA = with_identity(
    pa.schema(
        [
            pa.field("prompt_id", pa.string(), nullable=False),
            pa.field("prompt", pa.string(), nullable=False),
            pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("answer", pa.string(), nullable=False),
            pa.field("samples", pa.int32(), nullable=False),
            pa.field("task_type", pa.string(), nullable=False),
            pa.field("policy", pa.string(), nullable=False),
            pa.field("pool", pa.string(), nullable=False),
            pa.field("emitted_version", pa.int64(), nullable=False),
            pa.field("metadata", pa.map_(pa.string(), pa.string()), nullable=False),
        ]
    ),
    SCHEMA_NAME,
    SCHEMA_VERSION,
)


@dataclass(slots=True)
class Task:
    prompt_id: str
    """Unique id of the prompt within the run; the record key on the task topic."""
    prompt: str
    """The prompt text (workflows may re-tokenise it)."""
    prompt_ids: list[int] = field(default_factory=list)
    """Pre-tokenised prompt, empty when the workflow tokenises."""
    answer: str = ""
    """Reference answer the reward function checks against."""
    samples: int = 1
    """Group size: how many trajectories per policy this task must produce."""
    task_type: str = ""
    """Dataset/task family, usable by plug-ins for mixing and curricula."""
    policy: str = ""
    """Policy the task is routed to; "" means the workflow decides (multi-policy episodes)."""
    pool: str = "default"
    """RaaS pool (``<run>.tasks.<pool>``) that serves it."""
    emitted_version: int = 0
    """The weight version a node must serve before it starts the task: the latest announced when the
    dataflow emitted it, or (async, ``dataflow.emit_ahead``) the version that batches it served will
    produce."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Free-form string pairs (e.g. ``difficulty``); stored as ``map<string, string>``."""

    def validate(self) -> None:
        if not self.prompt_id:
            raise RecordSchemaError("Task.prompt_id is empty")
        if self.samples < 1:
            raise RecordSchemaError(f"Task {self.prompt_id}: samples must be >= 1, got {self.samples}")


def to_table(tasks: list[Task]) -> pa.Table:
    """Tasks as one Arrow table in :data:`SCHEMA` (validated)."""
    for t in tasks:
        t.validate()
    cols = {
        "prompt_id": [t.prompt_id for t in tasks],
        "prompt": [t.prompt for t in tasks],
        "prompt_ids": [list(t.prompt_ids) for t in tasks],
        "answer": [t.answer for t in tasks],
        "samples": [t.samples for t in tasks],
        "task_type": [t.task_type for t in tasks],
        "policy": [t.policy for t in tasks],
        "pool": [t.pool for t in tasks],
        "emitted_version": [t.emitted_version for t in tasks],
        "metadata": [list(t.metadata.items()) for t in tasks],
    }
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def from_table(table: pa.Table) -> list[Task]:
    """Tasks from a table written by :func:`to_table` (extra columns ignored, missing ones refused)."""
    table = conform(table, SCHEMA, SCHEMA_NAME, SCHEMA_VERSION)
    cols = table.to_pydict()
    out = []
    for i in range(table.num_rows):
        t = Task(
            prompt_id=cols["prompt_id"][i],
            prompt=cols["prompt"][i],
            prompt_ids=cols["prompt_ids"][i],
            answer=cols["answer"][i],
            samples=cols["samples"][i],
            task_type=cols["task_type"][i],
            policy=cols["policy"][i],
            pool=cols["pool"][i],
            emitted_version=cols["emitted_version"][i],
            metadata=map_to_dict(cols["metadata"][i]),
        )
        t.validate()
        out.append(t)
    return out
