"""Shared machinery of the versioned Arrow record schemas.

Every record table carries its schema name and version twice: in the Arrow schema metadata (so a
plain ``pyarrow`` reader of an IPC stream or Parquet file sees what it holds) and in the log record
headers (set by the producer). Readers accept extra columns (a newer minor writer) and refuse
missing ones with a clear :class:`RecordSchemaError`.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

SCHEMA_NAME_KEY = b"astraflow.schema"
SCHEMA_VERSION_KEY = b"astraflow.schema_version"


class RecordSchemaError(ValueError):
    """A table or record does not match the schema it claims (missing column, bad lengths, ...)."""


def with_identity(schema: pa.Schema, name: str, version: int) -> pa.Schema:
    """``schema`` with the record name and version stored in its metadata."""
    return schema.with_metadata({SCHEMA_NAME_KEY: name.encode(), SCHEMA_VERSION_KEY: str(version).encode()})


def identity_of(table: pa.Table) -> tuple[str, int] | None:
    """(schema name, version) from a table's metadata, or ``None`` when it carries none."""
    meta = table.schema.metadata or {}
    if SCHEMA_NAME_KEY not in meta:
        return None
    return meta[SCHEMA_NAME_KEY].decode(), int(meta.get(SCHEMA_VERSION_KEY, b"0"))


def conform(table: pa.Table, schema: pa.Schema, name: str, version: int) -> pa.Table:
    """Select and cast ``table``'s columns to ``schema``; refuse a wrong record kind or version."""
    ident = identity_of(table)
    if ident is not None:
        got_name, got_version = ident
        if got_name != name:
            raise RecordSchemaError(f"table holds {got_name!r} records, expected {name!r}")
        if got_version > version:
            raise RecordSchemaError(
                f"{name} schema version {got_version} is newer than this reader's {version}; upgrade astraflow"
            )
    if table.schema.equals(schema, check_metadata=False):
        # What our own writers produce, column for column (the common case): no select, no cast.
        return table.replace_schema_metadata(schema.metadata)
    present = set(table.column_names)
    missing = [f.name for f in schema if f.name not in present]
    if missing:
        raise RecordSchemaError(f"{name} table lacks column(s) {missing}; has {table.column_names}")
    try:
        selected = table.select(schema.names)
        if selected.schema.equals(schema, check_metadata=False):
            # What our own writers produce: a cast would only copy the columns (~100 us a record).
            return selected.replace_schema_metadata(schema.metadata)
        return selected.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise RecordSchemaError(f"{name} table columns do not cast to schema v{version}: {exc}") from None


def map_to_dict(value: Any) -> dict:
    """Arrow map values come back from ``to_pylist`` as lists of pairs."""
    if value is None:
        return {}
    return dict(value)
