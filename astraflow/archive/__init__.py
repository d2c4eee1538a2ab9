"""Trajectory archive: a run's log as Parquet in the bucket, for offline research.

Contract
--------
* **Who.** The archiver is a stateless consumer in its own group (``<run>.archive``) on
  ``<run>.trajectories``, ``<run>.batches.<policy>``, ``<run>.weights.<policy>`` and ``<run>.metrics``.
  Its position is its committed offsets; it holds nothing else.
* **What.** ``<run>/archive/kind=<kind>/policy=<policy>/part-<topic>-<partition>-<first offset>.parquet``
  (``metrics`` has no policy level). Kinds: ``trajectories`` (every trajectory as on the log),
  ``batches`` (each batch's composition: batch id, trainer version, episode ids), ``weights`` (the
  version timeline) and ``metrics`` (every record, as JSON plus common columns). Every row carries
  ``log_partition``, ``log_offset``, ``log_timestamp_ms``. The Parquet footer names the record schema
  and version (``astraflow.schema``, ``astraflow.schema_version``), the kind, topic, partition and
  first/last offsets. Schemas: :mod:`astraflow.archive.rows`.
* **Exactly once.** Names depend only on (topic, partition, first offset); a part is uploaded
  before its offsets are committed; a part uploaded but not committed before a crash is rewritten
  under the same name with the same rows (its footer's last offset fixes where the rewrite ends).
* **Flush** by records, bytes or age per partition, and at the end (SIGTERM / ``--idle-exit``).
"""

from astraflow.archive.archiver import Archiver, ArchiveStats
from astraflow.archive.rows import KINDS, SCHEMAS

__all__ = ["KINDS", "SCHEMAS", "ArchiveStats", "Archiver"]
