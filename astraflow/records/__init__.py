"""Versioned Arrow records exchanged over the log: Task, Trajectory, Batch.

Each record module has ``SCHEMA_NAME``, ``SCHEMA_VERSION``, ``SCHEMA`` (a ``pa.Schema`` whose
metadata names the record), ``to_table`` and ``from_table``. Column types: token ids and versions
``list<int32>``, log-probs ``list<float32>``, loss mask ``list<int8>``, dict fields
``map<string, string>`` (Task.metadata) and ``map<string, double>`` (Trajectory.rewards).

The JSON control records (trainer events, node status, dataflow counters, autoscaling reports, weight
announcements) are typed models in
:mod:`astraflow.records.control`, read with :func:`parse_control`.
"""

from astraflow.records import batch, control, task, trajectory
from astraflow.records.batch import Batch
from astraflow.records.control import ControlRecordError, parse_control
from astraflow.records.schema import RecordSchemaError, identity_of
from astraflow.records.task import Task
from astraflow.records.trajectory import Trajectory, episode_id_for, group_id_for

SCHEMAS = {m.SCHEMA_NAME: m.SCHEMA_VERSION for m in (task, trajectory, batch)}
"""Record schema name -> version, e.g. for ``LogConsumer(expected_schemas=...)``."""

__all__ = [
    "SCHEMAS",
    "Batch",
    "ControlRecordError",
    "RecordSchemaError",
    "Task",
    "Trajectory",
    "batch",
    "control",
    "episode_id_for",
    "group_id_for",
    "identity_of",
    "parse_control",
    "task",
    "trajectory",
]
