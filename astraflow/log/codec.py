"""The record format: a value is one Arrow IPC stream (or a small JSON document), described by headers.

Headers (UTF-8 strings; see docs/record-format.md):

``schema``          schema name, e.g. ``trajectory``
``schema-version``  decimal integer
``producer``        id of the component that wrote the record
``policy``          policy name, only when the record belongs to one
``content-type``    ``application/vnd.apache.arrow.stream`` or ``application/json``
``claim``           only for claim checks: bucket key of the payload (the value is then empty)
``claim-sha256``    hex sha256 of the payload in the bucket
``claim-size``      payload size in bytes

Anything beyond these headers is left alone, so any Kafka client plus ``pyarrow.ipc.open_stream``
reads an inline record.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from astraflow.log.errors import MissingHeaderError, PayloadError, SchemaMismatchError

H_SCHEMA = "schema"
H_SCHEMA_VERSION = "schema-version"
H_PRODUCER = "producer"
H_POLICY = "policy"
H_CONTENT_TYPE = "content-type"
H_CLAIM = "claim"
H_CLAIM_SHA256 = "claim-sha256"
H_CLAIM_SIZE = "claim-size"

ARROW_STREAM = "application/vnd.apache.arrow.stream"
JSON = "application/json"
CONTENT_TYPES = (ARROW_STREAM, JSON)

METRICS_SCHEMA = ("json", 1)
"""(name, version) of the untyped JSON records on ``<run>.metrics`` (``LogProducer.send_json``'s default);
the typed control records there have their own (``astraflow.records.control.METRICS_TOPIC_SCHEMAS``)."""
WEIGHT_ANNOUNCEMENT_SCHEMA = ("weight-announcement", 1)
"""(name, version) of the JSON records on ``<run>.weights.<policy>``."""

# Headers and the record-batch framing need room beside the largest inline value.
_FRAMING_HEADROOM = 64 * 1024
_BROKER_DEFAULT_MAX_BYTES = 1024 * 1024


def max_record_bytes(inline_limit_bytes: int) -> int:
    """The largest record a client must be able to send or fetch: an inline value of up to
    ``inline_limit_bytes`` (a dead letter carries one too) with its headers, never below the
    broker's 1 MiB default."""
    return max(_BROKER_DEFAULT_MAX_BYTES, inline_limit_bytes + _FRAMING_HEADROOM)


Headers = list[tuple[str, bytes]]
"""kafka-python's header form: ``[(name, value bytes), ...]``."""

ExpectedSchemas = Mapping[str, "int | tuple[str, int] | frozenset[tuple[str, int]]"]
"""What a consumer accepts: ``{schema_name: version}`` and/or ``{topic: version}``,
``{topic: (schema_name, version)}`` or ``{topic: frozenset({(schema_name, version), ...})}`` (a topic
that carries several kinds of record, e.g. ``<run>.metrics``). A topic entry wins over a schema-name entry."""

JsonCheck = Callable[[Any], object]
"""Parses a decoded JSON document of one schema into its typed record; raises a
:class:`~astraflow.log.errors.DecodeError` (whose ``reason`` goes into the dead letter) for one that
breaks the schema."""

_JSON_CHECKS: dict[tuple[str, int], JsonCheck] = {}


def register_json_check(schema_name: str, schema_version: int, check: JsonCheck) -> None:
    """Have every decoder in this process run ``check`` on each JSON record of ``(schema_name,
    schema_version)``: a record it refuses is dead-lettered like an undecodable one, and what it returns
    is handed out with the record (:attr:`Message.record <astraflow.log.message.Message.record>`). The
    typed control records register theirs (:mod:`astraflow.records.control`), so a consumer hands each
    out parsed, once, and never one that does not parse."""
    _JSON_CHECKS[(schema_name, schema_version)] = check


@dataclass(frozen=True)
class RecordMeta:
    """The parsed headers of one record."""

    schema_name: str
    schema_version: int
    producer: str
    content_type: str
    policy: str | None = None
    claim_key: str | None = None
    claim_sha256: str | None = None
    claim_size: int | None = None

    def to_headers(self) -> Headers:
        headers = [
            (H_SCHEMA, self.schema_name.encode()),
            (H_SCHEMA_VERSION, str(self.schema_version).encode()),
            (H_PRODUCER, self.producer.encode()),
            (H_CONTENT_TYPE, self.content_type.encode()),
        ]
        if self.policy is not None:
            headers.append((H_POLICY, self.policy.encode()))
        if self.claim_key is not None:
            headers += [
                (H_CLAIM, self.claim_key.encode()),
                (H_CLAIM_SHA256, (self.claim_sha256 or "").encode()),
                (H_CLAIM_SIZE, str(self.claim_size).encode()),
            ]
        return headers

    @classmethod
    def from_headers(cls, headers: Sequence[tuple[str, bytes | None]] | None) -> RecordMeta:
        """Parse kafka-python headers; raise :class:`MissingHeaderError` naming what is missing."""
        found: dict[str, str] = {}
        for name, raw in headers or ():
            try:
                found[name] = (raw or b"").decode()
            except UnicodeDecodeError:
                raise MissingHeaderError(f"header {name!r} is not UTF-8") from None
        missing = [h for h in (H_SCHEMA, H_SCHEMA_VERSION, H_CONTENT_TYPE) if h not in found]
        if missing:
            raise MissingHeaderError(
                f"record lacks header(s) {', '.join(missing)} (has: {', '.join(sorted(found)) or 'none'}); "
                "not written by an AstraFlow producer?"
            )
        try:
            version = int(found[H_SCHEMA_VERSION])
        except ValueError:
            raise MissingHeaderError(f"header schema-version={found[H_SCHEMA_VERSION]!r} is not an integer") from None
        if found[H_CONTENT_TYPE] not in CONTENT_TYPES:
            raise PayloadError(f"unknown content-type {found[H_CONTENT_TYPE]!r}; expected one of {CONTENT_TYPES}")
        claim_key = found.get(H_CLAIM)
        claim_size = None
        if claim_key is not None:
            if not found.get(H_CLAIM_SHA256) or H_CLAIM_SIZE not in found:
                raise MissingHeaderError("claim-checked record lacks claim-sha256 or claim-size")
            try:
                claim_size = int(found[H_CLAIM_SIZE])
            except ValueError:
                raise MissingHeaderError(f"header claim-size={found[H_CLAIM_SIZE]!r} is not an integer") from None
        return cls(
            schema_name=found[H_SCHEMA],
            schema_version=version,
            producer=found.get(H_PRODUCER, ""),
            content_type=found[H_CONTENT_TYPE],
            policy=found.get(H_POLICY),
            claim_key=claim_key,
            claim_sha256=found.get(H_CLAIM_SHA256),
            claim_size=claim_size,
        )


def check_schema(meta: RecordMeta, topic: str, expected: ExpectedSchemas | None) -> None:
    """Raise :class:`SchemaMismatchError` unless ``expected`` accepts the record; ``None`` accepts all."""
    if not expected:
        return
    want = expected.get(topic)
    if isinstance(want, (set, frozenset)):
        if (meta.schema_name, meta.schema_version) in want:
            return
        raise SchemaMismatchError(
            f"record on {topic} has schema {meta.schema_name!r} v{meta.schema_version}, this consumer "
            f"expects one of {sorted(want)} (producer {meta.producer or '?'})"
        )
    if want is not None:
        name, version = want if isinstance(want, tuple) else (meta.schema_name, want)
    elif meta.schema_name in expected:
        name, version = meta.schema_name, expected[meta.schema_name]
    else:
        raise SchemaMismatchError(
            f"record on {topic} has schema {meta.schema_name!r} v{meta.schema_version}, which this "
            f"consumer does not expect (expects {dict(expected)})"
        )
    if (meta.schema_name, meta.schema_version) != (name, version):
        raise SchemaMismatchError(
            f"record on {topic} has schema {meta.schema_name!r} v{meta.schema_version}, this consumer "
            f"expects {name!r} v{version} (producer {meta.producer or '?'})"
        )


class ArrowCodec:
    """Arrow IPC stream <-> bytes, JSON <-> bytes. Uncompressed: Arrow buffers of token ids and floats
    compress poorly and these machines are CPU-bound."""

    @staticmethod
    def encode_table(table: pa.Table | pa.RecordBatch) -> memoryview:
        """One IPC stream (schema message, record batches, end-of-stream marker)."""
        if not isinstance(table, (pa.Table, pa.RecordBatch)):
            raise TypeError(f"expected a pyarrow Table or RecordBatch, got {type(table).__name__}")
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write(table)
        # A view of Arrow's buffer: kafka-python copies it into the record batch once, we don't.
        return memoryview(sink.getvalue())

    @staticmethod
    def decode_table(value: bytes | memoryview) -> pa.Table:
        try:
            return pa.ipc.open_stream(pa.py_buffer(value)).read_all()
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise PayloadError(f"value is not an Arrow IPC stream ({len(value)} bytes): {exc}") from None

    @staticmethod
    def encode_json(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()

    @staticmethod
    def decode_json(value: bytes | memoryview) -> Any:
        try:
            return json.loads(bytes(value))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PayloadError(f"value is not a JSON document ({len(value)} bytes): {exc}") from None

    def decode(self, meta: RecordMeta, payload: bytes | memoryview) -> pa.Table | Any:
        """The table (Arrow) or object (JSON) that ``payload`` holds."""
        if meta.content_type == ARROW_STREAM:
            return self.decode_table(payload)
        return self.decode_json(payload)


def checked_record(meta: RecordMeta, obj: Any) -> object | None:
    """What the check registered for the record's schema (:func:`register_json_check`) makes of its JSON
    document ``obj`` (a control record's model); None for a schema without one. Raises the check's
    :class:`~astraflow.log.errors.DecodeError` for a document that breaks the schema."""
    check = _JSON_CHECKS.get((meta.schema_name, meta.schema_version))
    return None if check is None else check(obj)
